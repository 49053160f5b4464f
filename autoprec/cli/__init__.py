"""The ``autoprec`` command line: one thin typer wrapper per library call."""

#: The arguments of the running command (``tune --workers`` re-launches them in children).
current_argv: list[str] = []


def target_names() -> str:
    """The device profiles of the shipped ``autoprec/cost/devices.yaml`` ("h100, h200, …"),
    for the ``--target`` help, as the profiles module lists them (``profile_names``: read
    without importing torch, which every command's start would pay)."""
    from autoprec.cost.profiles import profile_names
    from autoprec.errors import InputError

    try:
        return ", ".join(profile_names())
    except InputError:
        return "see autoprec/cost/devices.yaml"
