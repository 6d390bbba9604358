"""``gpuslice sim``: replay a production trace through the placement engine."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from pathlib import Path

import httpx
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gpuslice_cli.table import show as show_table
from gpuslice_common.config import without_password
from gpuslice_common.ledger import LedgerError
from gpuslice_scheduler.sim import (
    DRA_FIRST_FIT,
    GPUSLICE,
    PLACEMENTS,
    POLICIES,
    SPLIT_COUNT,
    Derivation,
    RunResult,
    TraceError,
    load_nodes,
    load_pods,
    parse_seeds,
    replay_many,
    summarise,
    trace_name,
)
from gpuslice_scheduler.via import replay_via

POLICY_HELP = f"placement policy, repeatable: {', '.join(POLICIES)}"
PLACEMENT_HELP = (
    f"who places the pods, repeatable: {', '.join(PLACEMENTS)} (gpuslice: the engine chooses"
    " node and cards; dra-first-fit: DRA without the extender, kube-scheduler's node scores and"
    " first-fit cards; dra+extender: the engine's best node, first-fit cards)"
)
console = Console()
errors = Console(stderr=True)


def sim(
    nodes: Path = typer.Option(
        ...,
        "--nodes",
        help="node list CSV (sn, cpu_milli, memory_mib, gpu, model), e.g. openb's (see above)",
    ),
    pods: Path = typer.Option(
        ..., "--pods", help="pod list CSV (cpu_milli, memory_mib, num_gpu, gpu_milli[, gpu_spec])"
    ),
    policy: list[str] = typer.Option(["fragmentation"], "--policy", help=POLICY_HELP),
    placement: list[str] = typer.Option([GPUSLICE], "--placement", help=PLACEMENT_HELP),
    seed: int = typer.Option(42, "--seed", help="seed of the inflation draw and the shuffle"),
    seeds: str | None = typer.Option(
        None, "--seeds", help="several seeds, e.g. 42-51 (overrides --seed)"
    ),
    inflation: float = typer.Option(
        1.3, "--inflation", min=0.01, max=10.0, help="arrived demand to reach, x capacity"
    ),
    split_count: int = typer.Option(
        SPLIT_COUNT, "--split-count", min=1, max=1024, help="pods per card (deviceSplitCount)"
    ),
    jobs: int = typer.Option(1, "--jobs", min=1, max=256, help="runs in parallel processes"),
    sharing: float | None = typer.Option(
        None,
        "--sharing",
        min=0.0,
        max=1.0,
        help="derive a workload: sharing pods hold this share of the GPU demand (e.g. 0.8)",
    ),
    cpu_scale: float = typer.Option(
        1.0, "--cpu-scale", min=0.01, max=100.0, help="derive a workload: pods' CPU x this"
    ),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    plot: Path | None = typer.Option(
        None, "--plot", help="draw allocation vs arrived demand into this PNG"
    ),
    via: str | None = typer.Option(
        None, "--via", help="replay through the live extender at this URL instead"
    ),
    redis_url: str = typer.Option(
        "redis://127.0.0.1:6379/0", "--redis-url", help="the ledger of the --via extender"
    ),
    ledger_prefix: str = typer.Option("gpuslice", "--ledger-prefix", help="with --via"),
    sample: int = typer.Option(1000, "--sample", min=1, help="pods to replay with --via"),
    cpu_pods: bool = typer.Option(
        False,
        "--cpu-pods",
        help="with --via: send pods without GPUs through the extender too, not first-fit",
    ),
) -> None:
    """Replay a trace (FGD's published method) and report milli-GPU allocation.

    \b
    The openb traces are Alibaba's public GPU cluster trace, published at
    https://github.com/alibaba/clusterdata/tree/master/cluster-trace-gpu-v2023/csv
    (`make traces` fetches them into bench/traces/openb).
    """
    if cpu_pods and via is None:
        errors.print("[red]error:[/] --cpu-pods needs --via", soft_wrap=True)
        raise typer.Exit(2)
    if via is not None and (sharing is not None or cpu_scale != 1.0):
        errors.print(
            "[red]error:[/] --sharing and --cpu-scale derive offline replays only",
            soft_wrap=True,
        )
        raise typer.Exit(2)
    if via is not None and placement != [GPUSLICE]:
        errors.print("[red]error:[/] --placement is for offline replays only", soft_wrap=True)
        raise typer.Exit(2)
    if via is not None:
        replay_live(
            via,
            redis_url,
            ledger_prefix,
            nodes,
            pods,
            seed,
            sample,
            inflation,
            split_count,
            cpu_pods=cpu_pods,
        )
        return
    try:
        derivation = (
            Derivation(sharing, cpu_scale) if sharing is not None or cpu_scale != 1.0 else None
        )
        seed_list = parse_seeds(seeds) if seeds is not None else [seed]
        show = console.is_terminal and not as_json
        runs = {p: 1 if p == DRA_FIRST_FIT else len(policy) for p in dict.fromkeys(placement)}
        total = sum(runs.values()) * len(seed_list)
        with Progress(
            TextColumn("replaying {task.description}"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"),
            TimeElapsedColumn(),
            console=errors,
            disable=not (show or errors.is_terminal),
            transient=True,
        ) as bar:
            task = bar.add_task(trace_name(pods, derivation), total=total)
            results = replay_many(
                nodes,
                pods,
                policy,
                seed_list,
                inflation=inflation,
                split_count=split_count,
                jobs=jobs,
                derivation=derivation,
                progress=lambda done: bar.update(task, completed=done),
                placements=placement,
            )
        if plot is not None:
            draw(results, plot, inflation)
    except TraceError as exc:
        errors.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2) from None
    report = {
        "trace": trace_name(pods, derivation),
        "inflation": inflation,
        "runs": [r.as_dict() for r in results],
        "mean": summarise(results),
    }
    if as_json:
        print(json.dumps(report))
        return
    table = Table(
        title=f"{report['trace']}: milli-GPU allocation at {inflation:.0%} arrived demand"
    )
    for column in ("policy", "seeds", "allocation %", "unallocated GPUs", "failed pods", "s/run"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for name, row in summarise(results).items():
        table.add_row(
            name,
            str(row["seeds"]),
            f"{row['milli_gpu_allocation_ratio']:.2f}",
            f"{row['unallocated_gpus']:.1f}",
            f"{row['failed_pods']:.0f}",
            f"{row['wall_seconds']:.1f}",
        )
    show_table(console, table)


def draw(results: Sequence[RunResult], path: Path, inflation: float) -> None:
    """Mean allocation curve per policy against arrived demand, like the FGD paper's figure."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise TraceError("--plot needs matplotlib: pip install 'gpuslice[plot]'") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_policy: dict[str, list[list[float]]] = {}
    for r in results:
        by_policy.setdefault(r.label, []).append(r.curve)
    for name, curves in by_policy.items():
        length = min(len(c) for c in curves)
        mean = [sum(c[i] for c in curves) / len(curves) for i in range(length)]
        ax.plot(range(1, length + 1), mean, label=f"{name} ({mean[-1]:.1f}%)" if mean else name)
    ax.plot([0, 100 * inflation], [0, 100 * inflation], ":", color="grey", label="arrived")
    ax.set_xlabel("arrived GPU demand (% of capacity)")
    ax.set_ylabel("allocated milli-GPU (% of capacity)")
    ax.set_ylim(0, 105)
    ax.set_title(f"{results[0].trace}: {len(results)} run(s)" if results else "")
    ax.grid(alpha=0.3)
    ax.legend()
    try:
        fig.savefig(os.fspath(path), dpi=110, bbox_inches="tight")
    except OSError as exc:
        raise TraceError(f"cannot write {path}: {exc.strerror}") from None
    finally:
        plt.close(fig)


def replay_live(
    url: str,
    redis_url: str,
    ledger_prefix: str,
    nodes: Path,
    pods: Path,
    seed: int,
    sample: int,
    inflation: float,
    split_count: int,
    *,
    cpu_pods: bool = False,
) -> None:
    """``--via``: one seed through a live extender; prints JSON."""
    try:
        result = asyncio.run(
            replay_via(
                url,
                redis_url,
                load_nodes(nodes),
                load_pods(pods),
                seed=seed,
                sample=sample,
                inflation=inflation,
                split_count=split_count,
                ledger_prefix=ledger_prefix,
                cpu_pods=cpu_pods,
            )
        )
    except (TraceError, LedgerError, httpx.HTTPError) as exc:
        errors.print(f"[red]error:[/] {escape(str(exc) or type(exc).__name__)}", soft_wrap=True)
        raise typer.Exit(2) from None
    via = without_password(url)  # a login in the URL stays off the output
    print(json.dumps({"trace": trace_name(pods), "via": via, "seed": seed, **result.as_dict()}))
