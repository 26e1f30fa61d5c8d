"""PNG plots of serving runs (matplotlib, imported only here: ``pip install matplotlib``).

- ``slo_attainment.png``: SLO attainment vs request rate, one line per setup;
- ``itl_cdf_<rate>.png``: the CDF of inter-token latency per setup at each rate;
- ``ttft_over_time_<rate>.png``: each request's TTFT against its send time;
- ``roles_over_time_<setup>_<rate>.png``: where a setup's roles changed during the run (an
  elastic cluster), its prefill workers over time against the prompt and output
  tokens/s the requests asked for.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def available() -> bool:
    """Whether matplotlib imports (the plots are optional)."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plots need matplotlib: pip install matplotlib") from None
    return plt


def write_all(directory: str, runs: dict[str, list], slos_ms: dict[str, float]) -> list[Path]:
    """``runs`` maps a setup's label to its ``RunResult``s (one per rate)."""
    plt = _plt()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if slos_ms:
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, results in runs.items():
            ax.plot(
                [r.rate for r in results], [r.metrics["slo_attainment"] for r in results], "o-", label=label
            )
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("SLO attainment")
        ax.set_ylim(0, 1.05)
        ax.set_title("SLO attainment (" + ", ".join(f"{k} <= {v:g} ms" for k, v in slos_ms.items()) + ")")
        ax.grid(alpha=0.3)
        ax.legend()
        written.append(_save(fig, out / "slo_attainment.png"))
    rates = sorted({r.rate for results in runs.values() for r in results})
    for rate in rates:
        fig, ax = plt.subplots(figsize=(6, 4))
        fig2, ax2 = plt.subplots(figsize=(6, 4))
        for label, results in runs.items():
            for r in results:
                if r.rate != rate:
                    continue
                itl = np.sort([g * 1000 for rec in r.records if rec.success for g in rec.itls])
                if len(itl):
                    ax.plot(itl, np.arange(1, len(itl) + 1) / len(itl), label=label)
                ok = [rec for rec in r.records if rec.success]
                t0 = min((rec.send_time for rec in r.records), default=0.0)
                ax2.scatter(
                    [rec.send_time - t0 for rec in ok], [rec.ttft * 1000 for rec in ok], s=8, label=label
                )
        ax.set_xscale("log")
        ax.set_xlabel("inter-token latency (ms)")
        ax.set_ylabel("fraction of gaps")
        ax.set_title(f"ITL CDF at {rate:g} req/s")
        ax.grid(alpha=0.3)
        ax.legend()
        ax2.set_xlabel("send time (s)")
        ax2.set_ylabel("TTFT (ms)")
        ax2.set_yscale("log")
        ax2.set_title(f"TTFT over the run at {rate:g} req/s")
        ax2.grid(alpha=0.3)
        ax2.legend()
        written.append(_save(fig, out / f"itl_cdf_{rate:g}.png"))
        written.append(_save(fig2, out / f"ttft_over_time_{rate:g}.png"))
        for label, results in runs.items():
            for r in results:
                if r.rate == rate and r.metrics.get("over_time", {}).get("role_changes"):
                    name = f"roles_over_time_{label.replace(':', '').replace('/', '_')}_{rate:g}.png"
                    written.append(_roles(plt, r.metrics["over_time"], out / name))
    return written


def _roles(plt, over_time: dict, path: Path) -> Path:
    """Prefill workers (a step line) over the demand (``loadgen.timeline``'s record)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    demand = np.array(over_time["demand"])
    ax.step(demand[:, 0], demand[:, 1], where="post", label="prompt tok/s asked")
    ax.step(demand[:, 0], demand[:, 2], where="post", label="output tok/s asked")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("tokens/s")
    roles = np.array(over_time["roles"] + [[demand[-1, 0] + over_time["bin_s"], *over_time["roles"][-1][1:]]])
    twin = ax.twinx()
    twin.step(roles[:, 0], roles[:, 1], where="post", color="black", label="prefill workers")
    twin.set_ylabel("prefill workers (the rest decode)")
    twin.set_ylim(-0.1, max(roles[:, 1].max(), 1) + 0.5)
    ax.legend(loc="upper left")
    twin.legend(loc="upper right")
    ax.set_title("roles over time against demand")
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.clf()
    return path
