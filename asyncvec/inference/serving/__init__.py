"""Model servers: the ``asyncvec serve`` app (`server`), servers run as child processes (`server_process`), and
`EngineSupervisor` (`supervisor`), which restarts a dead or hung server with the last published weights."""
