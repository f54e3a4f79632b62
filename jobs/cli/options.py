"""`tokenmill run`'s job options, generated from the job spec model (schemas.job_spec.JobSpec).

Each field of the spec is one option: `--<name>` (schemas.job_spec.OPTIONS names them; sections are flattened,
`sampling.max_tokens` is --max-tokens, `columns.prompt` is --prompt-column), with the field's description as help,
its default, its environment variable (Cli metadata) and its section as the help panel. The command receives the
values as flat keyword arguments and builds the spec with JobSpec.from_options, which validates them exactly as a
YAML spec is validated. A new field in JobSpec is a new option here with no edit.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import typer

from schemas.job_spec import OPTIONS, Option


def _cli_type(option: Option) -> tuple[Any, Any]:
    """The Python type Typer parses an option as, and its default. Choices and ranges are left to the spec's
    validation, so `run` and `submit` report a bad value with the same message."""
    ann = option.field.annotation
    nullable = get_origin(ann) in (Union, types.UnionType) and type(None) in get_args(ann)
    if nullable:
        ann = next(a for a in get_args(ann) if a is not type(None))
    while get_origin(ann) is Annotated:  # constraints (min_length, ...) are the spec's to check
        ann = get_args(ann)[0]
    if get_origin(ann) is Literal:
        ann = str
    if get_origin(ann) is tuple:  # stop strings: a repeatable option
        return list[str] | None, None
    if nullable:
        return ann | None, None
    return ann, option.field.default


def _parameter(option: Option) -> inspect.Parameter:
    kind, default = _cli_type(option)
    help_text = option.field.description or ""
    panel = f"Job spec: {option.path[0]}" if len(option.path) > 1 else "Job spec"
    flag = f"{option.flag}/--no-{option.flag[2:]}" if kind is bool else option.flag
    info = typer.Option(flag, help=help_text, envvar=option.cli.envvar, rich_help_panel=panel)
    return inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[kind, info])


def job_options(*, skip: tuple[str, ...] = ("input", "output"), only: tuple[str, ...] | None = None
                ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for a Typer command: adds one option per job spec field (except `skip`, which the command declares
    itself, e.g. as arguments; with `only`, just those) after the command's own parameters. The command takes them
    as `**options`: flat option names to values, with an option left unset (None where the field's default is not
    None) omitted. Raises KeyError for a name in `only` that is no option."""
    chosen = [OPTIONS[n] for n in only] if only is not None else list(OPTIONS.values())
    generated = [_parameter(o) for o in chosen if o.name not in skip]
    names = {p.name for p in generated}

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = [p for p in inspect.signature(command, eval_str=True).parameters.values()
               if p.kind is not p.VAR_KEYWORD]
        clash = names & {p.name for p in own}
        if clash:
            raise TypeError(f"{command.__name__} declares job spec options itself: {sorted(clash)}")

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            options = {n: kwargs.pop(n) for n in names}
            options = {n: v for n, v in options.items() if v is not None or OPTIONS[n].field.default is None}
            return command(**kwargs, **options)

        signature = inspect.Signature([*own, *generated])
        wrapper.__signature__ = signature  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()}
        return wrapper

    return decorate


def options_set_by_env(ctx: typer.Context) -> dict[str, str]:
    """Option name -> environment variable, for each option of the command of `ctx` whose value came from its
    environment variable (TOKENMILL_DEVICE, ...) rather than the command line: errors about such a value name the
    variable as well as the option."""
    found = {}
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name) if param.name else None
        if getattr(source, "name", None) == "ENVIRONMENT":  # click's ParameterSource (Typer vendors click)
            envvar = param.envvar if isinstance(param.envvar, str) else next(iter(param.envvar or ()), None)
            if envvar:
                found[param.name] = envvar
    return found


def options_given(ctx: typer.Context, names: set[str] | frozenset[str]) -> set[str]:
    """The options among `names` of the command of `ctx` whose value came from the command line or from their
    environment variable, not from their default."""
    given = set()
    for name in names:
        source = ctx.get_parameter_source(name)
        if getattr(source, "name", None) in ("COMMANDLINE", "ENVIRONMENT"):
            given.add(name)
    return given
