"""The sweep figure, drawn from a run directory's CSVs alone (so `specbench plot` can redraw it)."""

from __future__ import annotations

import itertools
from pathlib import Path

from .errors import SpecbenchError


def plot_run(run_dir: Path, name: str = "sweep.png") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    try:
        summary = pd.read_csv(run_dir / "summary.csv")
        # Methods that report no acceptance (transformers' own) leave no acceptance.csv.
        has_acceptance = (run_dir / "acceptance.csv").is_file()
        acceptance = (
            pd.read_csv(run_dir / "acceptance.csv")
            if has_acceptance
            else pd.DataFrame(columns=["method", "k", "position", "acceptance"])
        )
        verify = pd.read_csv(run_dir / "verify_cost.csv")
    except (OSError, ValueError) as e:
        raise SpecbenchError(
            f"cannot read the run's CSVs in {run_dir} ({str(e).splitlines()[0]}): pass a run directory"
        ) from None
    drafting = summary[summary["k"].notna()].sort_values("k")  # the rows of methods that take K
    if drafting.empty:
        raise SpecbenchError(f"{run_dir}/summary.csv has no method with a lookahead K: nothing to plot")
    verify = verify[verify["model"] == "target"]
    first = drafting.iloc[0]
    fig, (ax_speed, ax_accept, ax_verify) = plt.subplots(1, 3, figsize=(15, 4.5))
    fig.suptitle(
        f"{first['target']} <- {first['draft']} on {first['dataset']}, T={first['temperature']}, {first['device']}"
    )

    for (method, rows), color in zip(
        drafting.groupby("method", sort=False),
        itertools.cycle(plt.rcParams["axes.prop_cycle"].by_key()["color"]),
        strict=False,
    ):
        ax_speed.plot(rows["k"], rows["speedup"], "o-", color=color, label=f"{method}: measured", linewidth=2)
        if rows["predicted_speedup_verify"].notna().any():
            ax_speed.plot(
                rows["k"], rows["predicted_speedup"], "s:", color=color, label=f"{method}: predicted (verify free)"
            )
            ax_speed.plot(
                rows["k"],
                rows["predicted_speedup_verify"],
                "^--",
                color=color,
                label=f"{method}: predicted (measured verify)",
            )
    ax_speed.axhline(1.0, color="grey", linewidth=0.8)
    ax_speed.set(xlabel="lookahead K", ylabel="speedup over the target alone", title="speedup vs K")
    ax_speed.set_xticks(sorted(drafting["k"].unique()))
    ax_speed.legend(fontsize="small")

    for (method, k), rows in acceptance.groupby(["method", "k"], sort=False):
        ax_accept.plot(rows["position"], rows["acceptance"], "o-", label=f"{method} K={k}")
    ax_accept.set_xticks(sorted(acceptance["position"].unique()))
    ax_accept.set(
        xlabel="draft position", ylabel="accepted per verify step", title="acceptance by position", ylim=(0, 1.02)
    )
    ax_accept.legend(fontsize="small")

    ax_verify.plot(verify["tokens"], verify["ratio"], "o-")
    ax_verify.plot(verify["tokens"], [1.0] * len(verify), color="grey", linewidth=0.8, label="the formula's assumption")
    ax_verify.set_xticks(verify["tokens"])
    ax_verify.set(
        xlabel="tokens in one target forward (K+1)",
        ylabel="time / one-token forward",
        title=f"verification cost at {verify['context_tokens'].iloc[0]} tokens of context",
    )
    ax_verify.legend()

    fig.tight_layout()
    path = run_dir / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
