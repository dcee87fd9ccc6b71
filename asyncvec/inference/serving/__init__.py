"""Model servers: the ``asyncvec serve`` app (`server`) and servers run as child processes (`server_process`)."""
