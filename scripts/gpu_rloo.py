"""GPU check: one RLOO iteration with an in-process vLLM engine (not part of CI).

    python scripts/gpu_rloo.py            # needs a CUDA GPU and `pip install -e .[vllm]`

1. builds a tiny Llama (head size 64, for vLLM's kernels) with build_tiny_lm: no download;
2. RLOO with ``--backend vllm``: k completions per prompt from VLLMPolicy, scored by the
   RewardService (``length_penalty``: rewards differ, so the update moves the weights);
3. the learner's (transformers, on the GPU) log-probs of the sampled tokens against vLLM's;
4. one learner update, then ``publish``: VersionManager -> VLLMPolicy.load_weights;
5. the next completions report version 1, and vLLM's log-probs match the updated learner's.

Prints one PASS/FAIL line per check, writes them to $OUT/gpu_rloo.log when $OUT is set, and
exits 1 if any check failed. Environment: LOGP_TOL (default 2e-3).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOL = float(os.environ.get("LOGP_TOL", "2e-3"))
LOG = Path(os.environ["OUT"]) / "gpu_rloo.log" if os.environ.get("OUT") else None
FAILS: list[str] = []


def report(ok: bool, name: str, detail: str) -> bool:
    line = f"{'PASS' if ok else 'FAIL'} {name}: {detail}"
    print(line, flush=True)
    if LOG is not None:
        LOG.parent.mkdir(parents=True, exist_ok=True)
        with LOG.open("a") as log:
            log.write(line + "\n")
    if not ok:
        FAILS.append(name)
    return ok


def learner_vs_engine(agent, batch) -> float:
    """Largest |learner log-prob - vLLM log-prob| over the batch's sampled tokens."""
    import torch

    from asyncvec.lm.training import trainable_batch

    data = trainable_batch(batch, agent.parts, agent.args, min_group_samples=2)
    with torch.no_grad():
        learner = data.logps(agent.learner, agent.args.temperature)
    return float((learner - data.behavior_logp).abs()[data.mask].max())


def run(work: Path) -> None:
    import torch

    if not report(
        torch.cuda.is_available(),
        "cuda",
        torch.cuda.get_device_name(0) if torch.cuda.is_available() else "torch sees no GPU",
    ):
        return
    try:
        import vllm
    except ImportError as exc:
        report(False, "vllm import", f"{exc}; install it with pip install -e .[vllm]")
        return
    report(True, "vllm import", f"vllm {vllm.__version__}")

    from asyncvec.agents.rloo import RLOO, Args
    from asyncvec.inference import build_tiny_lm

    folder = build_tiny_lm(work / "tiny-llama", arch="llama", n_layer=2, n_embd=128, n_head=2, seed=0)
    engine = {"dtype": "float32", "gpu_memory_utilization": 0.3, "enforce_eager": True}
    args = Args(
        model=str(folder),
        backend="vllm",
        vllm_engine=json.dumps(engine),
        device="cuda",
        mode="sync",
        reward="length_penalty",
        group_size=4,
        prompts_per_update=8,
        max_new_tokens=8,
        learning_rate=1e-2,
        eval_prompts=0,
        progress=False,
        timeout_s=300,
    )
    try:
        agent = RLOO(args)
    except Exception as exc:
        report(False, "RLOO(--backend vllm) start", f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
        return
    try:
        batch = agent.collector.collect(8, timeout=300)
        lengths = [len(s.output.token_ids) for group in batch.completions for s in group]
        report(
            batch.rewards.shape == (8, 4) and (batch.policy_version == 0).all() and min(lengths) > 0,
            "generate k completions per prompt",
            f"rewards {batch.rewards.shape}, versions {set(batch.policy_version.ravel().tolist())}, "
            f"token counts {min(lengths)}..{max(lengths)}",
        )
        gap = learner_vs_engine(agent, batch)
        report(gap <= TOL, "vLLM log-probs vs learner (version 0)", f"max |diff| = {gap:.2e} (tolerance {TOL:g})")

        before = {k: v.detach().clone() for k, v in agent.learner.state_dict().items()}
        stats = agent.update(batch)
        moved = max(float((agent.learner.state_dict()[k] - v).abs().max()) for k, v in before.items())
        report(
            math.isfinite(stats["losses/loss"]) and moved > 0,
            "learner update (transformers on cuda)",
            f"loss {stats['losses/loss']:.4f}, largest weight change {moved:.2e}",
        )

        version = agent.publish()
        report(
            version == 1 and agent.policy.policy_version == 1,
            "publish -> VLLMPolicy.load_weights",
            f"version {version}, policy reports {agent.policy.policy_version}",
        )

        after = agent.collector.collect(8, timeout=300)
        report(
            (after.policy_version == 1).all(),
            "next generation reports the new version",
            f"versions {set(after.policy_version.ravel().tolist())}",
        )
        gap = learner_vs_engine(agent, after)
        report(
            gap <= TOL, "vLLM log-probs vs updated learner (version 1)", f"max |diff| = {gap:.2e} (tolerance {TOL:g})"
        )
    except Exception as exc:
        report(False, "RLOO iteration", f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
    finally:
        try:
            agent.close()
            report(True, "close", "policy, reward service and generator closed")
        except Exception as exc:
            report(False, "close", f"{type(exc).__name__}: {exc}")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="asyncvec-gpu-rloo-") as work:
        try:
            run(Path(work))
        except Exception as exc:  # any surprise is a FAIL line, never a bare traceback only
            report(False, "gpu_rloo", f"{type(exc).__name__}: {exc}")
            traceback.print_exc()
    print(f"gpu_rloo: {'FAILED ' + ', '.join(FAILS) if FAILS else 'all checks passed'}", flush=True)
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
