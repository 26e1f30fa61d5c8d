"""lm-evaluation-harness, a real external client, against splitserve's
``/v1/completions`` and against its own Hugging Face backend on the same float32
model: the scores should be equal.

    python -m splitserve.bench.lm_eval_compare --lm-eval-python ENV/bin/python

lm-eval stays out of splitserve's dependencies (it pulls datasets, evaluate,
scikit-learn...): give the Python of an environment that has it (``pip install
lm-eval``; it needs no GPU). Two tasks from local data files written here, so no
hub is needed:

- ``splitserve_mc`` (loglikelihood, ``multiple_choice``): arithmetic and capitals
  questions with four choices, scored by each choice's logprob given the question,
  which lm-eval asks for with ``echo`` + ``logprobs`` + ``max_tokens: 1``;
- ``splitserve_qa`` (``generate_until``): short answers, greedy, up to a newline,
  scored by exact match.

splitserve serves SmolLM2-135M-Instruct in float32, disaggregated (one prefill and
one decode worker: every request's KV crosses the handoff), via ``splitserve serve``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
    ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Russia", "Moscow"), ("Greece", "Athens"), ("Peru", "Lima"),
    ("Kenya", "Nairobi"), ("Norway", "Oslo"), ("Poland", "Warsaw"), ("Cuba", "Havana"), ("Chile", "Santiago"),
]  # fmt: skip


def write_tasks(directory: Path) -> None:
    """The two tasks' data files and YAMLs under ``directory`` (``--include_path``)."""
    mc, qa = [], []
    for i, (country, capital) in enumerate(CAPITALS):
        others = [c for _, c in CAPITALS if c != capital][i % 5 : i % 5 + 3]
        choices = others[: i % 4] + [capital] + others[i % 4 :]
        mc.append({"question": f"What is the capital of {country}?", "choices": choices, "answer": i % 4})
        qa.append({"question": f"What is the capital of {country}?", "answer": capital})
    for a in range(2, 17):
        b = (a * 7) % 11 + 1
        right = a + b
        choices = [right + d for d in (-2, 1, 3)]
        choices.insert(a % 4, right)
        mc.append(
            {"question": f"What is {a} plus {b}?", "choices": [str(c) for c in choices], "answer": a % 4}
        )
        qa.append({"question": f"What is {a} plus {b}?", "answer": str(right)})
    for name, rows in (("mc", mc), ("qa", qa)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = 'dataset_path: json\ntest_split: train\ndoc_to_text: "Question: {{question}}\\nAnswer:"\n'
    (directory / "splitserve_mc.yaml").write_text(
        "task: splitserve_mc\n"
        + common
        + f"dataset_kwargs:\n  data_files: {directory / 'mc.jsonl'}\n"
        + 'output_type: multiple_choice\ndoc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
        + "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (directory / "splitserve_qa.yaml").write_text(
        "task: splitserve_qa\n"
        + common
        + f"dataset_kwargs:\n  data_files: {directory / 'qa.jsonl'}\n"
        + 'output_type: generate_until\ndoc_to_target: " {{answer}}"\n'
        + 'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 12\n  do_sample: false\n  temperature: 0\n'
        + "metric_list:\n  - metric: exact_match\n    ignore_case: true\n    ignore_punctuation: true\n"
        + '    regexes_to_ignore: ["^ "]\n'
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_lm_eval(python: str, model: str, model_args: str, tasks_dir: Path, out: Path) -> tuple[dict, dict]:
    """One lm-eval run: its ``results`` (task -> metric -> value) and its samples
    (task -> doc id -> the model's responses)."""
    cmd = [python, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks",
           "splitserve_mc,splitserve_qa", "--include_path", str(tasks_dir), "--output_path", str(out),
           "--batch_size", "1", "--seed", "0", "--log_samples"]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(cmd, check=True, env=os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    print(f"  {model}: {time.perf_counter() - started:.0f} s", flush=True)
    (result,) = sorted(out.rglob("results_*.json"))[-1:]
    samples: dict[str, dict[int, list]] = {}
    for path in out.rglob("samples_*.jsonl"):
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        for line in path.read_text().splitlines():
            row = json.loads(line)
            samples.setdefault(task, {})[row["doc_id"]] = row["resps"]
    return json.loads(result.read_text())["results"], samples


def _differences(served: dict, hf: dict) -> tuple[int, int, float]:
    """(multiple-choice answers whose greedy flag differs, generations that differ,
    the largest difference of a choice's loglikelihood), over every sample."""
    flags = generations = 0
    worst = 0.0
    for doc, resps in served["splitserve_mc"].items():
        for (a,), (b,) in zip(resps, hf["splitserve_mc"][doc]):
            worst = max(worst, abs(float(a[0]) - float(b[0])))
            flags += a[1] != b[1]
    for doc, resps in served["splitserve_qa"].items():
        generations += resps != hf["splitserve_qa"][doc]
    return flags, generations, worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lm-eval-python", required=True, help="a Python that has lm-eval installed")
    args = ap.parse_args(argv)
    from splitserve.bench.vs_vllm import wait_healthy
    from splitserve.engine.model.loader import resolve_source

    hf_dir = str(resolve_source("smollm2").directory)
    work = Path(tempfile.mkdtemp(prefix="lmeval-"))
    tasks = work / "tasks"
    tasks.mkdir()
    write_tasks(tasks)
    port, http_port = _free_port(), _free_port()
    cli = str(Path(sys.executable).parent / "splitserve")
    serve = [
        cli,
        "serve",
        "smollm2",
        "--dtype",
        "float32",
        "--port",
        str(port),
        "--http-port",
        str(http_port),
    ]
    log = open(work / "serve.log", "w")
    server = subprocess.Popen(serve, stdout=log, stderr=log)
    try:
        wait_healthy(f"http://127.0.0.1:{http_port}/health", server, 600)
        print("lm-eval runs (SmolLM2-135M-Instruct, float32):", flush=True)
        served, served_samples = run_lm_eval(
            args.lm_eval_python,
            "local-completions",
            f"model=smollm2,base_url=http://127.0.0.1:{http_port}/v1/completions,tokenizer={hf_dir},"
            "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1",
            tasks,
            work / "served",
        )
    finally:
        server.send_signal(2)
        server.wait(60)
    hf, hf_samples = run_lm_eval(
        args.lm_eval_python, "hf", f"pretrained={hf_dir},dtype=float32", tasks, work / "hf"
    )
    print(f"{'task':<14} {'metric':<20} {'splitserve':>10} {'hf':>8}")
    for task in ("splitserve_mc", "splitserve_qa"):
        for metric, value in sorted(served[task].items()):
            if isinstance(value, float) and "stderr" not in metric:
                print(f"{task:<14} {metric:<20} {value:>10.4f} {hf[task][metric]:>8.4f}")
    flags, generations, worst = _differences(served_samples, hf_samples)
    n_mc, n_qa = len(served_samples["splitserve_mc"]), len(served_samples["splitserve_qa"])
    print(
        f"per sample: the largest |loglikelihood difference| of a choice: {worst:.2e}; is-greedy flags that"
    )
    print(f"differ: {flags} (of {n_mc} questions' choices); generations that differ: {generations} of {n_qa}")
    print(f"(work files, logs and lm-eval's outputs: {work})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
