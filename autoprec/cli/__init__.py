"""The ``autoprec`` command line: one thin typer wrapper per library call."""

#: The arguments of the running command (``tune --workers`` re-launches them in children).
current_argv: list[str] = []


def target_names() -> str:
    """The device profiles of the shipped ``autoprec/cost/devices.yaml`` ("h100, h200, …"),
    for the ``--target`` help (read here: importing autoprec.cost would slow every
    command's start)."""
    from pathlib import Path

    import yaml

    try:
        data = yaml.safe_load((Path(__file__).resolve().parent.parent / "cost"
                               / "devices.yaml").read_text())
        return ", ".join(str(k) for k in data["devices"])
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return "see autoprec/cost/devices.yaml"
