"""The run's figures, drawn from its CSVs alone (so `specbench plot` can redraw them): the sweep
over K, and the time per generated token phase by phase."""

from __future__ import annotations

import itertools
from pathlib import Path

from specbench.core.errors import SpecbenchError
from specbench.core.options import FIXED
from specbench.methods.registry import BASELINE
from specbench.methods.served import SERVED_BASELINE
from specbench.results import schema
from specbench.results.schema import OWN_ENGINES
from specbench.results.summary import decoder_label


def plot_run(run_dir: Path, name: str = "sweep.png") -> Path | None:
    """Speedup vs K, acceptance by position and the verification cost (None: no method takes K)."""
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
        summary, acceptance = _own(_policies(summary)), _policies(acceptance)
        if summary.empty:  # only vLLM ran: plot_concurrency draws its figures
            return None
        verify = pd.read_csv(run_dir / "verify_cost.csv")
    except (OSError, ValueError) as e:
        raise SpecbenchError(
            f"cannot read the run's CSVs in {run_dir} ({str(e).splitlines()[0]}): pass a run directory"
        ) from None
    if "engine" in acceptance:
        acceptance = acceptance[acceptance["engine"].isin(OWN_ENGINES)]
    drafting = summary[summary["k"].notna()].sort_values("k")  # the rows of methods that draft
    has_tree = "tree" in drafting and drafting["tree"].notna().any()
    chains = drafting[drafting["tree"].isna()] if has_tree else drafting
    if drafting.empty:
        return None
    verify = verify[verify["model"] == "target"]
    first = drafting.iloc[0]
    fig, (ax_speed, ax_forward, ax_accept, ax_verify) = plt.subplots(1, 4, figsize=(20, 4.5))
    fig.suptitle(
        f"{first['target']} <- {first['draft']} on {first['dataset']}, T={first['temperature']}, {first['device']}"
    )

    for ((method, policy), rows), color in zip(
        chains.groupby(["method", "k_policy"], sort=False),
        itertools.cycle(plt.rcParams["axes.prop_cycle"].by_key()["color"]),
        strict=False,
    ):
        method += _suffix(policy)
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
    if not chains.empty:
        ax_speed.set_xticks(sorted(chains["k"].unique()))
        ax_speed.legend(fontsize="small")

    # Chains and trees on one axis: what each buys per target forward, and what that costs.
    for _, row in drafting.iterrows():
        is_tree = has_tree and pd.notna(row["tree"])
        label = f"{row['method']} {row['tree']}" if is_tree else f"{row['method']} K={int(row['k'])}"
        label += _suffix(row["k_policy"])
        ax_forward.scatter(row["tau"], row["speedup"], marker="^" if is_tree else "o")
        ax_forward.annotate(
            label, (row["tau"], row["speedup"]), fontsize="x-small", xytext=(3, 3), textcoords="offset points"
        )
    ax_forward.axhline(1.0, color="grey", linewidth=0.8)
    ax_forward.set(xlabel="tokens per target forward (tau)", ylabel="speedup", title="chains and trees")

    if "by" in acceptance:
        acceptance = acceptance[acceptance["by"] == "depth"]
    for (method, k, policy), rows in acceptance.groupby(["method", "k", "k_policy"], sort=False):
        for tree, branch in rows.groupby(
            rows["tree"].astype("string").fillna("") if "tree" in rows else [""] * len(rows)
        ):
            label = f"{method} {tree}" if tree else f"{method} K={k}{_suffix(policy)}"
            ax_accept.plot(branch["position"], branch["acceptance"], "o-", label=label)
    ax_accept.set_xticks(sorted(acceptance["position"].unique()))
    ax_accept.set(
        xlabel="draft position (depth)",
        ylabel="accepted per verify step",
        title="acceptance by position",
        ylim=(0, 1.02),
    )
    if len(acceptance):  # none when no row counted its drafts by position (hf-universal alone)
        ax_accept.legend(fontsize="small")

    # Bars span the interquartile range of the ratio within the repeats: the measurement's own noise.
    spread = verify["ratio_iqr"] / 2 if "ratio_iqr" in verify else None
    ax_verify.errorbar(verify["tokens"], verify["ratio"], yerr=spread, fmt="o-", capsize=3, label="measured")
    ax_verify.plot(verify["tokens"], [1.0] * len(verify), color="grey", linewidth=0.8, label="the formula's assumption")
    ax_verify.set_xticks(verify["tokens"])
    ax_verify.set(
        xlabel="tokens in one target forward (K+1)",
        ylabel="time / one-token forward",
        title=f"verification cost at {verify['context_tokens'].iloc[0]} tokens of context",
    )
    ax_verify.legend()

    return _saved(fig, run_dir / name)


PHASE_COLORS = dict(zip(schema.PHASES, ("#9e9e9e", "#4c9be8", "#8e6bd1", "#4caf50", "#e8834c", "#d64550"), strict=True))


def _summary(run_dir: Path):
    import pandas as pd

    try:
        return pd.read_csv(run_dir / "summary.csv")
    except (OSError, ValueError) as e:
        raise SpecbenchError(
            f"cannot read {run_dir}/summary.csv ({str(e).splitlines()[0]}): pass a run directory"
        ) from None


def _saved(fig, path: Path) -> Path:
    """Lay the figure out, write it to ``path`` and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _policies(df):
    """``df`` with a k_policy column of text ("" where a row has no K, and in runs made before policies)."""
    policy = df["k_policy"].fillna("") if "k_policy" in df else ""
    return df.assign(k_policy=policy)


def _suffix(policy: str) -> str:
    """What a label adds for a lookahead policy: nothing for a fixed K."""
    return f" {policy}" if policy not in ("", FIXED) else ""


def _own(summary):
    """The rows of specbench's loop (and transformers'): a serving engine's have no phases or forward costs."""
    return summary[summary["engine"].isin(OWN_ENGINES)].reset_index(drop=True) if "engine" in summary else summary


def plot_concurrency(run_dir: Path, name: str = "concurrency.png") -> Path | None:
    """vLLM at each concurrency: the speedup of all requests' throughput over the baseline's, and
    the median time per output token, one line per method and K (None: fewer than two concurrencies)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    try:
        summary = pd.read_csv(run_dir / "summary.csv")
    except (OSError, ValueError) as e:
        raise SpecbenchError(
            f"cannot read {run_dir}/summary.csv ({str(e).splitlines()[0]}): pass a run directory"
        ) from None
    served = summary[~summary["engine"].isin(OWN_ENGINES)] if "engine" in summary else summary.iloc[0:0]
    if "request_rate" in served:  # the loads of all-at-once arrivals: concurrency alone sets them
        served = served[served["request_rate"] == float("inf")]
    if served["concurrency"].nunique() < 2:
        return None
    fig, (ax_speed, ax_tpot) = plt.subplots(1, 2, figsize=(12, 4.5))
    first = served.iloc[0]
    who = "vLLM" if first["engine"] == "vllm" else "servers"
    fig.suptitle(f"{who}: {first['target']} <- {first['draft']} on {first['dataset']}, T={first['temperature']}")
    colors = itertools.cycle(plt.rcParams["axes.prop_cycle"].by_key()["color"])
    groups = served.groupby(["method", "k"], dropna=False, sort=False)
    for ((method, k), rows), color in zip(groups, colors, strict=False):
        rows = rows.sort_values("concurrency")
        label = method if pd.isna(k) else f"{method} K={int(k)}"
        if pd.isna(k):  # the baseline: 1 by definition
            ax_speed.axhline(1.0, color=color, linestyle=":", label=label)
        else:
            ax_speed.plot(rows["concurrency"], rows["throughput_speedup"], "o-", color=color, label=label)
        ax_tpot.plot(rows["concurrency"], rows["tpot_p50_ms"], "o-", color=color, label=label)
    ax_speed.set(xscale="log", xlabel="requests in flight", ylabel="throughput / baseline's", title="speedup")
    ax_tpot.set(xscale="log", xlabel="requests in flight", ylabel="ms", title="median time per output token")
    for ax in (ax_speed, ax_tpot):
        ax.set_xticks(sorted(served["concurrency"].unique()), labels=map(str, sorted(served["concurrency"].unique())))
        ax.legend(fontsize="small")
    return _saved(fig, run_dir / name)


def plot_pareto(run_dir: Path, name: str = "pareto.png") -> Path | None:
    """The serving engines' trade-off: each request's tokens/s against all requests' together, a curve
    per engine, method and K through its loads (requests in flight; request rates where those are
    what varies), the baseline's included; the points up and to the right of a curve are better
    (None: fewer than two loads)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    summary = _summary(run_dir)
    served = summary[~summary["engine"].isin(OWN_ENGINES)] if "engine" in summary else summary.iloc[0:0]
    axis = "concurrency" if served["concurrency"].nunique() > 1 else "request_rate"
    if served.empty or served[axis].nunique() < 2:
        return None
    fixed = "request_rate" if axis == "concurrency" else "concurrency"
    fig, ax = plt.subplots(figsize=(7.5, 5))
    first = served.iloc[0]
    names = [Path(str(first[key])).name for key in ("target", "draft", "dataset")]  # a temporary path's tail
    fig.suptitle(f"{names[0]} <- {names[1]} on {names[2]}, T={first['temperature']}: per request against in all")
    several = served[fixed].nunique() > 1
    for (engine, method, k, other), rows in served.groupby(["engine", "method", "k", fixed], dropna=False, sort=False):
        rows = rows.sort_values(axis)
        label = f"{engine} {method}" + ("" if pd.isna(k) else f" K={int(k)}")
        label += f" ({fixed.replace('_', ' ')} {other:g})" if several else ""
        style = "s--" if pd.isna(k) else "o-"  # the baseline dashed
        ax.plot(rows["throughput"], rows["spec_tokens_per_s"], style, label=label)
        for _, row in rows.iterrows():
            ax.annotate(f"{row[axis]:g}", (row["throughput"], row["spec_tokens_per_s"]), fontsize="x-small",
                        textcoords="offset points", xytext=(4, 4))  # fmt: skip
    unit = "requests in flight" if axis == "concurrency" else "requests/s"
    ax.set(xlabel="all requests' tokens/s", ylabel="tokens/s per request", title=f"each point's label: {unit}")
    ax.legend(fontsize="small")
    return _saved(fig, run_dir / name)


def plot_phases(run_dir: Path, name: str = "phases.png") -> Path | None:
    """Stacked bars of milliseconds per generated token (prefill, draft, verify, other), one bar per
    method and K with the baseline first, so a gap between methods shows in the phase it comes from."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    summary = _own(_policies(_summary(run_dir)))
    if summary.empty:
        return None
    labels = [
        m if pd.isna(k) else f"{m}\nK={int(k)}{_suffix(policy)}"
        for m, k, policy in zip(summary["method"], summary["k"], summary["k_policy"], strict=True)
    ]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(summary) + 2), 4.5))
    bottom = pd.Series(0.0, index=summary.index)
    # A phase no method spent time in (inner, without a cascade) is left out of the bars and legend.
    phases = {c: color for c, color in PHASE_COLORS.items() if c in summary and summary[c].fillna(0).any()}
    for column, color in phases.items():
        ms = 1000 * summary[column] / summary["new_tokens"]
        ax.bar(labels, ms, bottom=bottom, color=color, label=column.removesuffix("_s"))
        bottom += ms
    for x, (total, speedup) in enumerate(zip(bottom, summary["decode_speedup"], strict=True)):
        ax.annotate(f"{speedup:.2f}x", (x, total), ha="center", va="bottom", fontsize="small")
    first = summary.iloc[0]
    ax.set(
        ylabel="ms per generated token",
        title=f"where the time goes: {first['target']} on {first['dataset']}, {first['device']} "
        "(labels: decode speedup, prefill excluded)",
    )
    ax.set_ylim(top=1.2 * bottom.max())  # room for the labels and the legend above the bars
    ax.legend(loc="upper center", ncol=len(phases), fontsize="small")
    return _saved(fig, run_dir / name)


def plot_online(run_dir: Path, name: str = "online.png", window: int = 10) -> Path | None:
    """Alpha against prompt index for every chain method of the run, the drafts that learn and the
    ones that do not, as a rolling mean over ``window`` prompts (faint dots: each prompt), beside
    the seconds each update took. None when no method learned (no online.csv)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    if not (run_dir / "online.csv").is_file():
        return None
    try:
        records = _policies(pd.read_csv(run_dir / "records.csv"))
        online = _policies(pd.read_csv(run_dir / "online.csv"))
    except (OSError, ValueError) as e:
        raise SpecbenchError(f"cannot read the run's CSVs in {run_dir} ({str(e).splitlines()[0]})") from None
    chains = records[records["alpha"].notna() & records["k"].notna() & records["tree"].isna()]
    fig, (ax_alpha, ax_train) = plt.subplots(1, 2, figsize=(14, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    colors = itertools.cycle(plt.rcParams["axes.prop_cycle"].by_key()["color"])
    groups = chains.groupby(["method", "k", "k_policy"], sort=False)
    for ((method, k, policy), rows), color in zip(groups, colors, strict=False):
        rows = rows.sort_values("prompt_index")
        ax_alpha.scatter(rows["prompt_index"], rows["alpha"], s=6, alpha=0.25, color=color)
        smooth = rows["alpha"].rolling(window, min_periods=1).mean()
        label = f"{method} K={int(k)}{_suffix(policy)}"
        ax_alpha.plot(rows["prompt_index"], smooth, color=color, linewidth=2, label=label)
    ax_alpha.set(
        xlabel="prompt index (the order the run served them)",
        ylabel=f"alpha (rolling mean of {window} prompts)",
        title="acceptance as the run goes, with and without online updates",
    )
    ax_alpha.legend(fontsize="small")
    for (method, k, policy), rows in online.groupby(["method", "k", "k_policy"], sort=False):
        ax_train.bar(rows["prompt_index"], rows["train_s"], label=f"{method} K={int(k)}{_suffix(policy)}")
    ax_train.set(xlabel="prompt index", ylabel="seconds", title="training after each prompt (train_s)")
    ax_train.legend(fontsize="small")
    return _saved(fig, run_dir / name)


def plot_context(sweep_dir: Path, name: str = "context.png") -> Path | None:
    """A context sweep (context.csv): each method's decode speedup against context length, and the
    cost of the target's step beside each drafting level's c. None without context.csv."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    if not (sweep_dir / "context.csv").is_file():
        return None
    try:
        rows = _policies(pd.read_csv(sweep_dir / "context.csv"))
    except (OSError, ValueError) as e:
        raise SpecbenchError(f"cannot read {sweep_dir / 'context.csv'} ({str(e).splitlines()[0]})") from None
    fig, (ax_speed, ax_cost) = plt.subplots(1, 2, figsize=(13, 4.5))
    contexts = sorted(rows["context_tokens"].unique())
    costs: dict[tuple, list[str]] = {}  # methods that draft with the same level share one c curve
    drafting = rows[rows["c"].notna() | rows["alpha"].notna()]  # every method but the baseline
    for (method, k, policy), group in drafting.groupby(["method", "k", "k_policy"], sort=False, dropna=False):
        group = group.sort_values("context_tokens")
        label = method if pd.isna(k) else f"{method} K={int(k)}{_suffix(policy)}"
        ax_speed.plot(group["context_tokens"], group["decode_speedup"], marker="o", label=label)
        if group["c"].notna().any():
            costs.setdefault(tuple(zip(group["context_tokens"], group["c"], strict=True)), []).append(method)
    for curve, methods in costs.items():
        ax_cost.plot(*zip(*curve, strict=True), marker="o", label=f"c: {', '.join(dict.fromkeys(methods))}")
    ax_speed.axhline(1.0, color="grey", linewidth=1, linestyle="--")
    ax_speed.set(
        xscale="log",
        xlabel="context tokens",
        ylabel="decode speedup (prefill excluded)",
        title="speedup against context length (above the line: faster than the target alone)",
    )
    step = rows.drop_duplicates("context_tokens").sort_values("context_tokens")
    ax_step = ax_cost.twinx()
    ax_step.plot(step["context_tokens"], step["target_step_ms"], color="black", linestyle=":", marker="s")
    ax_step.set_ylabel("target one-token forward, ms (dotted)")
    ax_cost.set(xscale="log", xlabel="context tokens", ylabel="c (drafting step / target step)", title="costs")
    for ax in (ax_speed, ax_cost):
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.minorticks_off()
        ax.legend(fontsize="small")
    return _saved(fig, sweep_dir / name)


def plot_categories(run_dir: Path, name: str = "categories.png") -> Path | None:
    """A heat map of speedup over the baseline, a row per decoder and a column per category (or
    whatever --group-by grouped), each cell labelled with its speedup and tau. None without
    categories.csv."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import pandas as pd
    from matplotlib.colors import TwoSlopeNorm

    if not (run_dir / "categories.csv").is_file():
        return None
    try:
        rows = pd.read_csv(run_dir / "categories.csv", dtype={"category": str, "tree": str, "k_policy": str})
    except (OSError, ValueError) as e:
        raise SpecbenchError(f"cannot read {run_dir}/categories.csv ({str(e).splitlines()[0]})") from None
    rows = rows[~rows["method"].isin([BASELINE.name, SERVED_BASELINE.name])].fillna({"tree": "", "k_policy": ""})
    if rows.empty:
        return None
    labels = [decoder_label(row) for row in rows.to_dict("records")]
    rows = rows.assign(label=labels)
    order, categories = list(dict.fromkeys(labels)), list(dict.fromkeys(rows["category"]))
    speedup = rows.pivot(index="label", columns="category", values="speedup").reindex(index=order, columns=categories)
    tau = rows.pivot(index="label", columns="category", values="tau").reindex(index=order, columns=categories)
    values = speedup.to_numpy(float)
    spread = max(float(np.nanmax(np.abs(values - 1.0))), 0.05)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.05 * len(categories) + 3), max(2.5, 0.6 * len(order) + 1.8)))
    image = ax.imshow(values, cmap="RdYlGn", norm=TwoSlopeNorm(1.0, 1.0 - spread, 1.0 + spread), aspect="auto")
    for (i, j), value in np.ndenumerate(values):
        if not np.isnan(value):
            t = tau.iat[i, j]
            ax.text(
                j, i, f"{value:.2f}x" + ("" if pd.isna(t) else f"\nτ {t:.2f}"), ha="center", va="center", fontsize=8
            )
    shown = [f"turn {c}" for c in categories] if rows.iloc[0]["group_by"] == "turn" else categories
    ax.set_xticks(range(len(categories)), labels=shown, rotation=40, ha="right")
    ax.set_yticks(range(len(order)), labels=order)
    first = rows.iloc[0]
    ax.set_title(
        f"speedup by {first['group_by'].replace('_', ' ')} (τ: tokens per target forward)\n"
        f"{Path(str(first['target'])).name} on {Path(str(first['dataset'])).name}, T={first['temperature']}",
        fontsize=10,
    )
    fig.colorbar(image, ax=ax, label="speedup over the baseline")
    return _saved(fig, run_dir / name)
