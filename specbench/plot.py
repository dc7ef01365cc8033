"""The sweep figure, drawn from a run directory's CSVs alone (so `specbench plot` can redraw it)."""

from __future__ import annotations

from pathlib import Path

from .errors import SpecbenchError


def plot_run(run_dir: Path, name: str = "sweep.png") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    try:
        summary = pd.read_csv(run_dir / "summary.csv")
        acceptance = pd.read_csv(run_dir / "acceptance.csv")
        verify = pd.read_csv(run_dir / "verify_cost.csv")
    except (OSError, ValueError) as e:
        raise SpecbenchError(f"cannot read the run's CSVs in {run_dir} ({str(e).splitlines()[0]}): pass a run directory") from None
    spec = summary[summary.get("method", "speculative") == "speculative"].sort_values("k")
    first = spec.iloc[0]
    fig, (ax_speed, ax_accept, ax_verify) = plt.subplots(1, 3, figsize=(15, 4.5))
    fig.suptitle(
        f"{first['target']} <- {first['draft']} on {first['dataset']}, T={first['temperature']}, "
        f"{first['device']}, c={first['c']:.3f}"
    )

    ax_speed.plot(spec["k"], spec["speedup"], "o-", label="measured", linewidth=2)
    ax_speed.plot(spec["k"], spec["predicted_speedup"], "s--", label="predicted (verify free)")
    ax_speed.plot(spec["k"], spec["predicted_speedup_verify"], "^--", label="predicted (measured verify cost)")
    ax_speed.axhline(1.0, color="grey", linewidth=0.8)
    ax_speed.set(xlabel="lookahead K", ylabel="speedup over the target alone", title="speedup vs K")
    ax_speed.set_xticks(spec["k"])
    ax_speed.legend()

    for k, rows in acceptance.groupby("k"):
        ax_accept.plot(rows["position"], rows["acceptance"], "o-", label=f"K={k}")
    ax_accept.set_xticks(sorted(acceptance["position"].unique()))
    ax_accept.set(xlabel="draft position", ylabel="accepted per verify step", title="acceptance by position", ylim=(0, 1.02))
    ax_accept.legend(fontsize="small")

    ax_verify.plot(verify["tokens"], verify["ratio"], "o-")
    ax_verify.plot(verify["tokens"], [1.0] * len(verify), color="grey", linewidth=0.8, label="the formula's assumption")
    ax_verify.set_xticks(verify["tokens"])
    ax_verify.set(
        xlabel="tokens in one target forward (K+1)", ylabel="time / one-token forward",
        title=f"verification cost at {verify['context_tokens'].iloc[0]} tokens of context",
    )
    ax_verify.legend()

    fig.tight_layout()
    path = run_dir / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
