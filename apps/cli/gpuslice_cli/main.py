"""The ``gpuslice`` command."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any, NoReturn

import typer
from rich.console import Console
from typer.core import TyperGroup

import gpuslice_common
from gpuslice_cli.audit import audit
from gpuslice_cli.dev.up import driver, up
from gpuslice_cli.install import install
from gpuslice_cli.simulate import sim
from gpuslice_cli.smoke import run_scenario
from gpuslice_cli.status import status
from gpuslice_cli.table import closed_pipe
from gpuslice_common.bus import BusError
from gpuslice_common.config import CommonSettings, ConfigError, load
from gpuslice_common.ledger import LedgerError
from gpuslice_common.servers import NatsServer, RedisServer, ServerError


class PlainErrors(TyperGroup):
    """The ``gpuslice`` group: a bad command line is one line on stderr
    (``error: ...``, exit 2), like every other error of this command, not a
    boxed panel; stdout closed by its reader ends a command quietly, exit 0."""

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().make_context(*args, **kwargs)
        except typer.TyperException as exc:  # click's UsageError and the like
            one_line(exc)

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except typer.TyperException as exc:
            one_line(exc)
        except BrokenPipeError:
            closed_pipe()
            raise typer.Exit(0) from None


def one_line(exc: typer.TyperException) -> NoReturn:
    """Say what is wrong (with the command line, mostly) in one line, and exit
    with the exception's code (2 for a usage error)."""
    ctx = getattr(exc, "ctx", None)
    if ctx is not None and exc.format_message() == ctx.get_help():  # no_args_is_help
        typer.echo(exc.format_message(), err=True)
        raise typer.Exit(exc.exit_code)
    where = f" (see {ctx.command_path} --help)" if ctx is not None else ""
    message = " ".join(exc.format_message().split())
    typer.echo(f"error: {message}{where}", err=True)
    raise typer.Exit(exc.exit_code)


# plain help (no rich panels): a flag is shown without a value
app = typer.Typer(
    help="GPU sharing for Kubernetes.",
    no_args_is_help=True,
    add_completion=False,
    cls=PlainErrors,
    rich_markup_mode=None,
)
dev = typer.Typer(
    help="Run gpuslice on this machine, without a cluster.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(dev, name="dev")
dev.command("up")(up)
dev.command("driver")(driver)
app.command("sim")(sim)
app.command("status")(status)
app.add_typer(audit, name="audit")
app.add_typer(install, name="install")
console = Console()
errors = Console(stderr=True)


@app.command()
def version() -> None:
    """Print the version."""
    console.print(f"gpuslice {gpuslice_common.__version__}")


@contextlib.contextmanager
def local_servers(nats_url: str | None, redis_url: str | None) -> Iterator[tuple[str, str]]:
    """Start NATS and Redis as child processes unless URLs of running ones are given."""
    with contextlib.ExitStack() as stack:
        if nats_url is None:
            nats = stack.enter_context(NatsServer())
            nats_url = nats.url
            console.print(f"started nats-server on {nats_url} (JetStream in {nats.store_dir})")
        if redis_url is None:
            redis = stack.enter_context(RedisServer(persist=False))
            redis_url = redis.url
            console.print(f"started redis-server on {redis_url}")
        yield nats_url, redis_url


@dev.command()
def smoke(
    nats_url: str | None = typer.Option(None, help="use this NATS instead of starting one"),
    redis_url: str | None = typer.Option(None, help="use this Redis instead of starting one"),
) -> None:
    """Start NATS and Redis, run a ledger scenario end to end, and check the outcome."""
    try:
        with local_servers(nats_url, redis_url) as (nats, redis):
            settings = load(CommonSettings, nats_url=nats, redis_url=redis)
            outcome = asyncio.run(run_scenario(settings, console))
    except (ConfigError, ServerError, BusError, LedgerError) as exc:
        errors.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    for what, ok in outcome.checks:
        console.print(f"{'[green]ok[/]  ' if ok else '[red]FAIL[/]'} {what}")
    if not outcome.ok:
        raise typer.Exit(1)
    console.print("[bold green]smoke scenario passed[/]")


if __name__ == "__main__":
    app(prog_name="gpuslice")  # as messages name it, not "python -m gpuslice_cli.main"
