"""`flashbench list`, `show` and `validate`: reading the registry."""

from pathlib import Path

import click
from rich.table import Column, Table

from ..model.trace import printable_line
from ..validate import validate
from . import console, errors, main, repo_from, shown


@main.command("list")
@click.pass_context
def list_definitions(ctx):
    """Definitions with their op type and numbers of workloads and solutions."""
    repo = repo_from(ctx)
    names = repo.names()
    # Names are what people type next; never cut them short, even in a narrow terminal.
    name_column = Column("definition", no_wrap=True, min_width=max(map(len, names), default=10))
    table = Table(name_column, "op_type", "workloads", "solutions", "tags")
    for name in names:
        definition = repo.definition(name)
        workloads = repo.workload_set(name)
        table.add_row(name, shown(definition.op_type), str(len(workloads.workloads) if workloads else 0),
                      str(len(repo.solution_folders(name))), shown(" ".join(definition.tags)))
    console.print(table)


@main.command()
@click.argument("name")
@click.pass_context
def show(ctx, name):
    """Axes, inputs, outputs, constraints, tolerances, cost model and reference of a definition."""
    repo = repo_from(ctx)
    definition = repo.definition(name)
    path = repo.definition_path(name).relative_to(repo.root)
    # A definition's words are shown as text, its own escape sequences never sent (an imported dataset's, say)
    console.print(f"[bold]{definition.name}[/]  ({shown(definition.op_type)})  {shown(path)}", highlight=False)
    console.print("\n".join(map(printable_line, definition.description.splitlines())), highlight=False, markup=False)
    axes = Table("axis", "kind", "value", "description", title="axes")
    for axis_name, axis in definition.axes.items():
        axes.add_row(shown(axis_name), axis.type, "" if axis.value is None else str(axis.value), shown(axis.description))
    console.print(axes)
    tensors = Table("name", "role", "shape", "dtype", "description", title="inputs and outputs")
    for role, specs in (("input", definition.inputs), ("output", definition.outputs)):
        for tensor_name, spec in specs.items():
            shape = "scalar" if spec.shape is None else f"[{', '.join(spec.shape)}]"
            # shown: "[batch_size, ...]" would otherwise be read as rich markup and vanish
            kind = "input, constant" if role == "input" and spec.constant else role  # a model weight: not redrawn
            tensors.add_row(shown(tensor_name), kind, shown(shape), spec.dtype, shown(spec.description))
    console.print(tensors)
    console.print("[bold]constraints[/]")
    for constraint in definition.constraints:
        console.print(f"  {printable_line(constraint)}", highlight=False, markup=False)
    evaluator = definition.evaluator
    settings = " ".join(f"{k}={v}" for k, v in evaluator.model_dump(exclude={"kind"}).items())
    console.print(f"[bold]evaluator[/] {evaluator.kind} {settings}".rstrip(), highlight=False)
    if evaluator.kind == "allclose":  # the other evaluators have no per-output tolerances
        console.print("[bold]tolerances[/]")
        for output in definition.outputs:
            tol = definition.tolerance(output)
            console.print(f"  {output}: atol={tol.atol} rtol={tol.rtol} max_mismatch_fraction={tol.max_mismatch_fraction}")
    if definition.cost:
        console.print("[bold]cost model[/]")
        console.print(f"  bytes: {definition.cost.bytes}\n  flops: {definition.cost.flops}", highlight=False, markup=False)
    reference = definition.reference if definition.reference_is_path else "(embedded in the definition)"
    console.print(f"[bold]reference[/] {reference}")


@main.command("validate")
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@click.pass_context
def validate_command(ctx, paths):
    """Check definitions, workload sets and solution folders (the whole repo when no PATH is given)."""
    results = validate(repo_from(ctx), [p.resolve() for p in paths] or None)
    for checked in results:
        if checked.ok:
            console.print(f"[green]ok[/]      {checked.kind:<10} {shown(checked.path)}", highlight=False, soft_wrap=True)
        for error in checked.errors:  # a line each: every invalid workload of a file
            errors.print(f"[red]invalid[/] {checked.kind:<10} {shown(error)}", highlight=False, soft_wrap=True)
    bad = sum(not c.ok for c in results)
    console.print(f"{len(results) - bad} valid, {bad} invalid")
    if bad or not results:
        ctx.exit(2 if bad else 1)
