"""``gpuslice dev up``: the local stack with a live view, pod files or the demo.

While it runs, the terminal shows the ledger's nodes and cards (allocated and,
from telemetry, used), the latest audited events and what became of each pod;
at the end a summary. ``--demo`` runs a scripted scenario and exits non-zero if
any step misbehaves: two pods sharing one card, an allocation past its limit
refused inside the running process, a pod refused for its namespace's quota,
and every device released at the end. Given pod files, it runs them in order
(each after the one before has ended and its devices are released) and exits
0 only when every pod succeeded; the summary says which did not and
why, with the end of a failed container's output and where the whole is kept.
Without ``--demo`` or pod files, the stack stays up until Ctrl-C. Ctrl-C
always stops every child process.

At the start it prints where its NATS and Redis are and how to load its
``gpuslice.env`` (``set -a; . <dir>/gpuslice.env; set +a``), which lets
``gpuslice status`` and ``gpuslice audit tail`` reach them: the NATS password
is in that file (readable by this user only), never on the terminal. What
libraries write on their own (gRPC's core, Python loggers) goes to
``gpuslice-dev.log`` in the stack's directory, not into the view. That
directory, made for the run unless ``--workdir`` names one, is removed at the
end when all went well and ``--keep`` was not given; otherwise the last line
says where it is and how to remove it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import faulthandler
import logging
import os
import shlex
import shutil
import signal
import sys
import tempfile
import webbrowser
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer
import yaml
from redis.exceptions import RedisError
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from gpuslice_cli.dev.dra import CLAIMS
from gpuslice_cli.dev.driver import ClusterDriver, DriverError, PodOutcome
from gpuslice_cli.dev.stack import (
    DEFAULT_NODES,
    Attached,
    NodeSpec,
    Stack,
    StackError,
    nvidia_gpus,
)
from gpuslice_cli.status import gather_status, gather_usage, status_table
from gpuslice_cli.table import make_printable, printable, shorten, show
from gpuslice_common.bus import Bus, BusError
from gpuslice_common.config import CommonSettings, ConfigError, load, without_password
from gpuslice_common.events import CloudEvent
from gpuslice_common.ledger import Ledger, LedgerError
from gpuslice_common.models import PlacementState
from gpuslice_common.servers import ServerError
from gpuslice_common.service import every

QUOTA_NAMESPACE = "team-a"
# the static instances on each card of a --static-mig-nodes node
STATIC_MIG = ("3g.20gb", "3g.20gb")
# how much of a reason the live view shows, and of a failed container's output the summary
REASON_WIDTH = 70
TAIL_LINES = 20
# how long a pod file's next pod waits for the devices of the one before to be released
RELEASE_WAIT_S = 30.0
# where what libraries write on their own goes, in the stack's directory
FOREIGN_LOG = "gpuslice-dev.log"


@dataclass
class View:
    """What the live display shows."""

    events: deque[str] = field(default_factory=lambda: deque(maxlen=12))
    pods: list[PodOutcome] = field(default_factory=list)
    steps: list[tuple[str, bool, str]] = field(default_factory=list)
    status: Table | None = None

    def render(self) -> Group:
        parts: list[Any] = []
        if self.status is not None:
            parts.append(self.status)
        events = Table(title="events", show_header=False, expand=False)
        for line in self.events:
            events.add_row(escape(line))
        parts.append(events)
        if self.pods:
            parts.append(pods_table(self.pods, REASON_WIDTH))
        if self.steps:
            parts.append(steps_table(self.steps))
        for part in parts:
            make_printable(part)
        return Group(*parts)


def pods_table(pods: Sequence[PodOutcome], reason_width: int | None = None) -> Table:
    """What became of each pod; reasons cut to ``reason_width`` (with an
    ellipsis) when given, whole otherwise."""
    table = Table(title="pods")
    for name in ("pod", "phase", "node", "GPUs", "reason"):
        table.add_column(name)
    for pod in pods:
        uuids = ",".join(sorted(gpus_of(pod)))
        reason = pod.reason if reason_width is None else shorten(pod.reason, reason_width)
        table.add_row(
            escape(pod.ref),
            pod.phase,
            escape(pod.node or "-"),
            escape(uuids or "-"),
            escape(reason),
        )
    return table


def gpus_of(pod: PodOutcome) -> set[str]:
    """What the GPUs column names: each card granted by its UUID's last 8
    characters, a MIG instance as ``<card>/<profile>``, and a static MIG
    device (``nvidia.com/mig-<profile>``) as ``<its UUID's last 8>/<profile>``."""
    out = set()
    if pod.placement is not None:
        for container in pod.placement.containers:
            for grant in container.devices:
                mig = f"/{grant.mig.profile}" if grant.mig is not None else ""
                out.add(f"{grant.uuid[-8:]}{mig}")
    for run in pod.containers:
        for resource, ids in run.extended.items():
            kind = resource.partition("/")[2]
            label = f"/{kind.removeprefix('mig-')}" if kind.startswith("mig-") else ""
            out.update(f"{device[-8:]}{label}" for device in ids)
    return out


def failures(pods: Sequence[PodOutcome]) -> list[str]:
    """For each pod that did not succeed: which and why; for each of its
    containers that failed, the end of its output and where the whole is. No
    line holds a newline or a character a terminal acts on (:func:`printable`)."""
    lines: list[str] = []
    for pod in pods:
        if pod.phase == "Succeeded":
            continue
        lines.append(f"pod {pod.ref}: {pod.phase}: {pod.reason or 'no reason given'}")
        for run in pod.containers:
            if run.returncode in (0, None):
                continue
            where = f" ({run.log_path})" if run.log_path is not None else ""
            lines.append(f"  container {run.name} exited {run.returncode}; its output{where} ends:")
            lines += [f"    {line}" for line in run.tail(TAIL_LINES).splitlines()]
    # names and reasons come from pod files, the output from the containers
    return [printable(line.replace("\n", " ")) for line in lines]


def steps_table(steps: Sequence[tuple[str, bool, str]]) -> Table:
    table = Table(title="demo")
    table.add_column("step")
    table.add_column("result")
    table.add_column("detail")
    for what, ok, detail in steps:
        table.add_row(escape(what), "[green]ok[/]" if ok else "[red]FAIL[/]", escape(detail))
    return table


def probe_pod(
    name: str, command: list[str], mem: int, namespace: str = "default"
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "cuda",
                    "command": command,
                    "resources": {"limits": {"nvidia.com/gpu": 1, "nvidia.com/gpumem": mem}},
                }
            ]
        },
    }


async def demo(driver: ClusterDriver, ledger: Ledger, view: View) -> None:
    """The scripted scenario; each step's verdict goes into ``view.steps``."""
    stack = driver.stack

    def step(what: str, ok: bool, detail: str) -> None:
        view.steps.append((what, ok, detail))

    hold = ["probe", "init", "ctx", "alloc", "2g", "sleep", "2000"]
    first, second = await asyncio.gather(
        driver.run_pod(probe_pod("share-a", hold, 8000)),
        driver.run_pod(probe_pod("share-b", hold, 8000)),
    )
    view.pods += [first, second]
    cards = [
        {g.uuid for c in p.placement.containers for g in c.devices} if p.placement else set()
        for p in (first, second)
    ]
    shared = bool(cards[0] & cards[1]) and first.phase == second.phase == "Succeeded"
    step("two pods share one card", shared, f"both on {', '.join(cards[0]) or '-'}")

    over = await driver.run_pod(
        probe_pod("over-limit", ["probe", "init", "ctx", "alloc", "1g", "alloc", "2g"], 2000)
    )
    view.pods.append(over)
    lines = over.containers[0].output.splitlines() if over.containers else []
    allocs = [line for line in lines if '"cmd":"alloc"' in line]
    refused = len(allocs) == 2 and '"rc":0' in allocs[0] and '"rc":2' in allocs[1]
    step(
        "an allocation past the 2000 MiB limit fails inside the process",
        refused,
        "1 GiB allocated, 2 GiB more refused (CUDA_ERROR_OUT_OF_MEMORY)"
        if refused
        else str(allocs),
    )

    stack.kube.add_resource_quota(
        QUOTA_NAMESPACE,
        {"metadata": {"name": "gpu"}, "spec": {"hard": {"limits.nvidia.com/gpumem": "4000"}}},
    )
    greedy = await driver.run_pod(
        probe_pod("greedy", ["probe", "init"], 8000, namespace=QUOTA_NAMESPACE)
    )
    view.pods.append(greedy)
    step(
        "a pod over its namespace's GPU memory quota is refused",
        greedy.phase == "Denied" and "exceeded quota" in greedy.reason,
        shorten(greedy.reason, 90),
    )

    left = -1
    for _ in range(100):
        left = 0
        for node in stack.nodes:
            for placement in await ledger.node_placements(node.name):
                left += placement.state is not PlacementState.RELEASED
        if left == 0:
            break
        await asyncio.sleep(0.2)
    step("every device released at the end", left == 0, f"{left} placements still held")
    if any(node.dra for node in stack.nodes):
        claims = await stack.kube.list_objects(CLAIMS)
        step("every claim released at the end", not claims, f"{len(claims)} claims left")


async def _watch_events(bus: Bus, view: View) -> Any:
    async def keep(event: CloudEvent) -> None:
        subject = event.subject or ""
        reason = str(event.data.get("reason") or "") if isinstance(event.data, dict) else ""
        kind = event.type.value.removeprefix("io.gpuslice.")
        view.events.append(f"{event.time:%H:%M:%S} {kind:16} {subject} {reason}".rstrip())

    return await bus.subscribe_events(bus.subjects.events_all, keep)


async def _refresh(ledger: Ledger, prefix: str, view: View) -> None:
    """The status table, every half second (``every`` ends it even when the Redis
    client swallows the cancellation, which it can do mid-command)."""

    async def once() -> None:
        nodes = await gather_status(ledger)
        view.status = status_table(nodes, await gather_usage(ledger, prefix, nodes))

    await every(0.5, once, "status refresh", expected=(LedgerError, RedisError))


@contextlib.asynccontextmanager
async def session(stack: Stack) -> AsyncIterator[tuple[ClusterDriver, Ledger, Bus]]:
    async with stack.running():
        # the view reads events as an auditor does
        bus = await Bus.connect(stack.bus_settings("auditor"), "gpuslice-dev")
        ledger = stack.ledger(retries=2)
        # on the stack's own NATS no user may report pod ends: the inventory's
        # pod watch sees them, as on a cluster
        driver = ClusterDriver(stack, bus if stack.nats_auth is None else None)
        try:
            yield driver, ledger, bus
        finally:
            await driver.close()
            await ledger.close()
            await bus.close()


async def run_up(
    stack: Stack,
    work: Callable[[ClusterDriver, Ledger, View], Any] | None,
    console: Console,
    live: bool,
    open_console: bool = False,
) -> View:
    view = View()
    main = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGHUP):  # Ctrl-C is asyncio.run's own
        if main is not None:
            loop.add_signal_handler(sig, main.cancel)
    async with session(stack) as (driver, ledger, bus):
        if stack.attached is None:
            where(stack, console)
            if open_console and stack.console_url is not None:
                webbrowser.open(stack.console_url)  # no browser here: nothing happens
        await _watch_events(bus, view)
        refresher = asyncio.create_task(_refresh(ledger, stack.prefix, view))
        display = Live(view.render(), console=console, refresh_per_second=4) if live else None
        try:
            with display or contextlib.nullcontext():
                ticker = asyncio.create_task(_tick(display, view))
                try:
                    if work is None:
                        if display is None:
                            console.print("gpuslice dev: the stack is up; Ctrl-C stops it")
                        await asyncio.Event().wait()  # until Ctrl-C
                    else:
                        await work(driver, ledger, view)
                    await asyncio.sleep(1.0)  # the last events and numbers
                finally:
                    ticker.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await ticker
        finally:
            refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refresher
    return view


def client_variables(stack: Stack) -> dict[str, str]:
    """The variables of the stack's env file: its servers and the auditor's login."""
    variables = {}
    for line in stack.env_file.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            variables[name] = value
    return variables


def where(stack: Stack, console: Console) -> None:
    """Where the servers and the web console are, and how to load the variables
    that let gpuslice status and audit reach them. No secret reaches the
    terminal (its scrollback, a recording, a shared screen): the auditor's NATS
    password stays in the env file, which only this user can read."""
    variables = client_variables(stack)
    nats = without_password(variables.get("GPUSLICE_NATS_URL", ""))
    user = variables.get("GPUSLICE_NATS_USER")
    login = f" (user {user}, its password in {stack.env_file})" if user else ""
    if stack.redis_sentinels:
        redis = (
            f"Redis through the sentinels at {stack.redis_sentinels}"
            f" (service {stack.redis_sentinel_service})"
        )
        more = "; two replicas each of the extender and the inventory"
    else:
        redis = f"Redis at {without_password(variables.get('GPUSLICE_REDIS_URL', ''))}"
        more = ""
    say = [f"gpuslice dev: NATS at {nats}{login}, {redis}{more}"]
    if stack.console_url is not None:
        say.append(f"gpuslice dev: console: {stack.console_url}")
    say += [
        "gpuslice dev: for gpuslice status and gpuslice audit tail, load its settings with:",
        f"set -a; . {shlex.quote(str(stack.env_file))}; set +a",
    ]
    for line in say:
        console.print(line, soft_wrap=True, markup=False, highlight=False)


async def _tick(display: Live | None, view: View) -> None:
    while display is not None:
        display.update(view.render())
        await asyncio.sleep(0.25)


def yaml_problem(path: Path, exc: yaml.YAMLError) -> str:
    """A YAML error in one line, naming the file and the line and column it
    points at (PyYAML's own text names ``<unicode string>`` over several lines)."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else f"{path}"
        what = " ".join(part for part in (exc.context, exc.problem) if part)
        return f"{where}: {' '.join(what.split()) or 'not valid YAML'}"
    if isinstance(exc, yaml.reader.ReaderError):  # not text: bad UTF-8, a control character
        return f"{path}, byte {exc.position}: {exc.reason}"
    return f"{path}: {' '.join(str(exc).split())}"


def load_pods(paths: Sequence[Path]) -> list[dict[str, Any]]:
    pods: list[dict[str, Any]] = []
    for path in paths:
        try:
            documents = list(yaml.safe_load_all(path.read_bytes()))
        except OSError as exc:
            raise DriverError(f"cannot read pods from {path}: {exc.strerror or exc}") from None
        except yaml.YAMLError as exc:
            raise DriverError(f"cannot read pods from {yaml_problem(path, exc)}") from None
        for doc in documents:
            if doc is None:
                continue
            if not isinstance(doc, dict) or doc.get("kind", "Pod") != "Pod":
                raise DriverError(f"{path}: only Pod documents can be run here")
            pods.append(doc)
    return pods


def _work(demo_: bool, pods: Sequence[Path] | None) -> Callable[..., Any] | None:
    if demo_:
        return demo
    if not pods:
        return None
    specs_to_run = load_pods(pods)

    async def run_files(driver: ClusterDriver, ledger: Ledger, view: View) -> None:
        for spec in specs_to_run:
            meta = spec.get("metadata") or {}
            namespace = str(meta.get("namespace") or "default")
            try:
                outcome = await driver.run_pod(spec, namespace=namespace)
            except DriverError as exc:  # this pod cannot run; the others still do
                name = str(meta.get("name") or "-")
                view.pods.append(PodOutcome(name, namespace, "", "Failed", str(exc)))
                continue
            view.pods.append(outcome)
            if outcome.placement is not None:  # the next pod finds its devices free
                await released(ledger, outcome.uid)

    return run_files


async def released(ledger: Ledger, uid: str) -> None:
    """Until the ledger holds the pod's devices no longer (the inventory
    releases them when it sees the pod gone), or RELEASE_WAIT_S passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RELEASE_WAIT_S
    while loop.time() < deadline:
        with contextlib.suppress(LedgerError, RedisError):  # the store away: ask again
            held = await ledger.placement(uid)
            if held is None or held.state is PlacementState.RELEASED:
                return
        await asyncio.sleep(0.1)


@contextlib.contextmanager
def foreign_output_to(path: Path) -> Iterator[None]:
    """While the block runs, whatever is written to file descriptor 2 (gRPC's
    C core, absl) and Python's log records go to ``path``; this program's own
    messages to stderr still reach the terminal."""
    sys.stderr.flush()
    saved = os.dup(2)
    with path.open("ab") as log_file:
        os.dup2(log_file.fileno(), 2)
    own = os.fdopen(os.dup(saved), "w", buffering=1, encoding="utf-8", errors="replace")
    previous = sys.stderr
    sys.stderr = own
    dumps = faulthandler.is_enabled()  # PYTHONFAULTHANDLER: stack dumps stay on the terminal
    if dumps:
        faulthandler.enable(own)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()
        sys.stderr = previous
        os.dup2(saved, 2)
        os.close(saved)
        if dumps:
            faulthandler.enable(previous)
        own.close()


def _run(
    stack: Stack,
    demo_: bool,
    pods: Sequence[Path] | None,
    plain: bool,
    open_console: bool = False,
    temporary: bool = False,
    keep: bool = False,
) -> None:
    """Run the stack with its work and print the summary; exit as the outcome
    says. A ``temporary`` directory (made for this run) is removed at the end
    when the run went well and ``keep`` is not asked; otherwise it is kept (its
    logs say why a run failed) and the last line says where and how to remove it."""
    console = Console()
    errors = Console(stderr=True)
    try:
        work = _work(demo_, pods)
        stack.workdir.mkdir(parents=True, exist_ok=True)
    except (DriverError, OSError) as exc:
        if temporary:  # nothing in it yet
            shutil.rmtree(stack.workdir, ignore_errors=True)
        errors.print(f"[red]error:[/] {escape(printable(str(exc)))}", soft_wrap=True)
        raise typer.Exit(2) from None
    note = (
        " (removed at the end if all goes well; --keep keeps it)" if temporary and not keep else ""
    )
    console.print(
        f"gpuslice dev: logs under {stack.workdir}{note}", soft_wrap=True, highlight=False
    )
    went_well = False
    try:
        _outcome(stack, work, console, errors, plain, open_console)
        went_well = True
    finally:
        if temporary:
            leave(stack.workdir, console, remove=went_well and not keep)


def leave(workdir: Path, console: Console, remove: bool) -> None:
    """Remove the run's own directory, or say where it stays and how to remove it."""
    if remove:
        shutil.rmtree(workdir, ignore_errors=True)
        if not workdir.exists():
            return
    quoted = shlex.quote(str(workdir))
    console.print(
        f"gpuslice dev: logs kept in {workdir}; remove them with:  rm -r {quoted}",
        soft_wrap=True,
        markup=False,
        highlight=False,
    )


def _outcome(
    stack: Stack,
    work: Callable[..., Any] | None,
    console: Console,
    errors: Console,
    plain: bool,
    open_console: bool,
) -> None:
    """Run the stack, print the summary; typer.Exit(1) when a pod or a demo step
    failed, typer.Exit(2) when the stack could not run."""
    try:
        with foreign_output_to(stack.workdir / FOREIGN_LOG):
            live = not plain and console.is_terminal
            view = asyncio.run(run_up(stack, work, console, live=live, open_console=open_console))
    except (KeyboardInterrupt, asyncio.CancelledError):
        console.print("stopped: every process of the stack has been shut down")
        return
    except (StackError, DriverError, ServerError, BusError, LedgerError, OSError) as exc:
        errors.print(f"[red]error:[/] {escape(printable(str(exc)))}", soft_wrap=True)
        raise typer.Exit(2) from None
    if view.status is not None:
        show(console, view.status)
    if view.pods:
        show(console, pods_table(view.pods))
    if view.steps:
        show(console, steps_table(view.steps))
        if not all(ok for _, ok, _ in view.steps):
            console.print("[bold red]the demo misbehaved[/]")
            raise typer.Exit(1)
        console.print("[bold green]demo passed[/]")
        return
    lines = failures(view.pods)
    if lines:
        for line in lines:
            console.print(line, soft_wrap=True, markup=False, highlight=False)
        failed = sum(p.phase != "Succeeded" for p in view.pods)
        console.print(
            f"[bold red]{failed} of {len(view.pods)} pods did not succeed[/]", highlight=False
        )
        raise typer.Exit(1)


KEEP_HELP = "keep the run's directory (logs, each container's output) when all went well"
DEMO_HELP = "run the scripted scenario and exit"
PODS_HELP = "pod YAML files to run, in order"
PLAIN_HELP = "no live display, only the summary"


def up(
    demo_: bool = typer.Option(False, "--demo", help=DEMO_HELP),
    pods: list[Path] = typer.Argument(None, help=PODS_HELP),
    nodes: int = typer.Option(2, "--nodes", min=1, max=8, help="simulated GPU nodes"),
    mig_nodes: int = typer.Option(
        0,
        "--mig-nodes",
        min=0,
        max=8,
        help="of the simulated nodes, how many (the last) have MIG cards of the A100-40GB "
        "geometry, shared by MIG instances made at Allocate (operatingMode mig)",
    ),
    static_mig_nodes: int = typer.Option(
        0,
        "--static-mig-nodes",
        min=0,
        max=8,
        help="of the simulated nodes, how many (the last before the --mig-nodes) have MIG "
        "cards of the A100-40GB geometry each holding two static 3g.20gb instances, "
        "advertised as nvidia.com/mig-3g.20gb (migStrategy mixed)",
    ),
    nats_url: str | None = typer.Option(
        None, help="use this NATS, without users, instead of starting one with the cluster's"
    ),
    redis_url: str | None = typer.Option(None, help="use this Redis instead of starting one"),
    workdir: Path | None = typer.Option(
        None, help="logs and state, kept (default: a new temp dir, removed at a good end)"
    ),
    keep: bool = typer.Option(False, "--keep", help=KEEP_HELP),
    plain: bool = typer.Option(False, "--plain", help=PLAIN_HELP),
    gpu: str = typer.Option(
        "auto",
        "--gpu",
        help="auto: the first node uses this machine's NVIDIA GPUs when NVML sees any; "
        "fake: every node is simulated; real: require a GPU",
    ),
    ha: bool = typer.Option(
        False,
        "--ha",
        help="the highly-available shapes: a three-member NATS cluster, Redis with "
        "sentinels and replicas, two replicas each of the extender and the inventory",
    ),
    open_console: bool = typer.Option(
        False, "--open", help="open the web console in this machine's browser"
    ),
    dra: bool = typer.Option(
        False,
        "--dra",
        help="DRA mode: nodes publish ResourceSlices, pods get ResourceClaims (not with MIG)",
    ),
) -> None:
    """Run gpuslice on this machine: NATS, Redis, the four services, simulated nodes
    and a cluster driver that admits, schedules, allocates and runs pods."""
    if gpu not in ("auto", "fake", "real"):
        Console(stderr=True).print(f"[red]error:[/] --gpu is auto, fake or real, not {gpu!r}")
        raise typer.Exit(2)
    if ha and (nats_url or redis_url):
        Console(stderr=True).print(
            "[red]error:[/] --ha starts its own NATS cluster and Redis:"
            " no --nats-url or --redis-url"
        )
        raise typer.Exit(2)
    if mig_nodes + static_mig_nodes > nodes:
        Console(stderr=True).print(
            f"[red]error:[/] --mig-nodes {mig_nodes} and --static-mig-nodes {static_mig_nodes}"
            f" are more than the {nodes} --nodes"
        )
        raise typer.Exit(2)
    specs = tuple(
        DEFAULT_NODES[i] if i < len(DEFAULT_NODES) else NodeSpec(f"gpu-node-{i + 1}")
        for i in range(nodes)
    )
    a100_40gb = NodeSpec("", model="NVIDIA A100-SXM4-40GB", memory_mib=40960)
    kinds = {
        i: dataclasses.replace(a100_40gb, mig=True) for i in range(nodes - mig_nodes, nodes)
    } | {
        i: dataclasses.replace(a100_40gb, static_mig=STATIC_MIG)
        for i in range(nodes - mig_nodes - static_mig_nodes, nodes - mig_nodes)
    }
    specs = tuple(
        dataclasses.replace(kinds[i], name=s.name, gpus=s.gpus) if i in kinds else s
        for i, s in enumerate(specs)
    )
    if dra and (mig_nodes or static_mig_nodes):
        Console(stderr=True).print("[red]error:[/] --dra runs no MIG nodes")
        raise typer.Exit(2)
    if dra:
        specs = tuple(dataclasses.replace(s, dra=True) for s in specs)
    if gpu != "fake":
        count, why = nvidia_gpus()
        if count:
            specs = (dataclasses.replace(specs[0], real=True), *specs[1:])
        elif gpu == "real":
            Console(stderr=True).print(f"[red]error:[/] no NVIDIA GPU here: {why}")
            raise typer.Exit(2)
    where = workdir or Path(tempfile.mkdtemp(prefix="gpuslice-dev-"))
    stack = Stack(where, specs, nats_url=nats_url, redis_url=redis_url, ha=ha)
    _run(stack, demo_, pods, plain, open_console, temporary=workdir is None, keep=keep)


def driver(
    nodes: list[str] = typer.Option(..., "--node", help="a node whose device plugin runs"),
    nats_url: str = typer.Option(..., help="the stack's NATS"),
    redis_url: str = typer.Option(..., help="the stack's Redis"),
    webhook_url: str = typer.Option(..., help="the webhook, e.g. http://webhook:8443"),
    extender_url: str = typer.Option(..., help="the extender, e.g. http://scheduler:8888"),
    inventory_url: str = typer.Option(..., help="the inventory, e.g. http://inventory:9090"),
    kubelet_root: Path = typer.Option(..., help="<dir>/<node>/kubelet.sock, shared with the nodes"),
    kubeconfig: Path = typer.Option(..., help="where to write the services' kubeconfig"),
    api_advertise: str = typer.Option(..., help="how services reach the API server"),
    api_port: int = typer.Option(6443, help="the API server's port"),
    api_token: str = typer.Option(
        "", envvar="GPUSLICE_DEV_API_TOKEN", help="a fixed bearer token (default: a fresh one)"
    ),
    demo_: bool = typer.Option(False, "--demo", help=DEMO_HELP),
    pods: list[Path] = typer.Argument(None, help=PODS_HELP),
    workdir: Path | None = typer.Option(
        None, help="state, kept (default: a new temp dir, removed at a good end)"
    ),
    keep: bool = typer.Option(False, "--keep", help=KEEP_HELP),
    plain: bool = typer.Option(False, "--plain", help=PLAIN_HELP),
) -> None:
    """The cluster driver alone, for services that run elsewhere (compose.yaml): it
    serves the API server and each node's kubelet and drives pods through them."""
    attached = Attached(
        webhook_url=webhook_url.rstrip("/"),
        extender_url=extender_url.rstrip("/"),
        inventory_url=inventory_url.rstrip("/"),
        kubelet_root=kubelet_root,
        kubeconfig=kubeconfig,
        api_advertise=api_advertise,
        api_port=api_port,
        api_token=api_token,
    )
    try:
        settings = load(CommonSettings)
    except ConfigError as exc:
        Console(stderr=True).print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    if settings.subject_prefix != settings.ledger_prefix:
        Console(stderr=True).print(
            "[red]error:[/] GPUSLICE_SUBJECT_PREFIX and GPUSLICE_LEDGER_PREFIX must be alike"
        )
        raise typer.Exit(2)
    where = workdir or Path(tempfile.mkdtemp(prefix="gpuslice-driver-"))
    stack = Stack(
        where,
        tuple(NodeSpec(name) for name in nodes),
        nats_url=nats_url,
        redis_url=redis_url,
        prefix=settings.ledger_prefix,
        attached=attached,
    )
    _run(stack, demo_, pods, plain, temporary=workdir is None, keep=keep)
