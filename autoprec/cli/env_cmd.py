"""``autoprec env``: versions, devices, and which precisions / fp8 backends run here."""

from __future__ import annotations

import importlib.metadata
import json
from typing import Annotated, Any

import typer

#: Distributions whose versions matter for a bug report; optional ones print "-".
PACKAGES = ("autoprec", "torch", "optuna", "mlflow", "pandas", "transformers", "transformer_engine")


def _version(dist: str) -> str | None:
    for name in (dist, dist.replace("_", "-")):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def env_info() -> dict[str, Any]:
    """Versions and the capability answers (autoprec.device.capability) for this machine."""
    from autoprec.device.capability import device_summary

    info = device_summary()
    versions = {"python": info.pop("python")}
    info.pop("torch", None)  # listed with the other versions
    for dist in PACKAGES:
        versions[dist] = _version(dist)
    if versions.get("autoprec") is None:  # running from a source tree, not installed
        from autoprec._version import __version__

        versions["autoprec"] = __version__
    return {"versions": versions, **info}


def env_cmd(
    json_out: Annotated[bool, typer.Option("--json", help="Print as JSON.")] = False,
) -> None:
    """Print versions, devices and the precisions and fp8 backends available here (or why not)."""
    info = env_info()
    if json_out:
        typer.echo(json.dumps(info, indent=2, default=str))
        return
    typer.echo("versions:")
    for name, ver in info["versions"].items():
        typer.echo(f"  {name:<20} {ver or '-'}")
    typer.echo("device:")
    for key, value in info.items():
        if key not in ("versions", "precisions", "fp8_backends"):
            typer.echo(f"  {key:<20} {value}")
    for section in ("precisions", "fp8_backends"):
        typer.echo(f"{section.replace('_', ' ')}:")
        for name, answer in info.get(section, {}).items():
            mark = "yes" if answer["ok"] else "no "
            typer.echo(f"  {name:<15} {mark}  {answer['reason']}")


def register(app: typer.Typer) -> None:
    app.command("env")(env_cmd)
