"""A host's memory budget: its node input, its setting or ``SUBQUAD_MEMORY_BUDGET``, refused in one wording.

The ComfyUI nodes and the AUTOMATIC1111 extension may use :data:`ENV_BUDGET`,
:func:`checked_budget` and :func:`env_budget`. (The installers' module, ``_hosts``, imports without
torch for the CLI; this one reads the core's budget and settings, so it is apart.)
"""

from __future__ import annotations

from subquad import ArgumentError

from .._for_wings import Budget, parse_budget, setting_text

ENV_BUDGET = "SUBQUAD_MEMORY_BUDGET"
"""The environment variable both hosts read a memory budget from when nothing else sets one."""


def checked_budget(text: object, where: str) -> Budget:
    """``text`` as a memory budget (``None`` when empty), checked now: a typo in a host's setting
    is refused when the node or setting is used, not at the first attention call.

    Raises:
        ArgumentError: one line that stands alone in the host's error dialog: ``where`` (the
            input, setting or variable, as the host names it), what would work, and the value.
    """
    value = str(text or "").strip()
    if not value:
        return None
    try:
        parse_budget(value)
    except ArgumentError:
        raise ArgumentError(
            f"{where}: expected bytes or a size like '512MiB' or '2GB', or nothing for the default; got {value!r}."
        ) from None
    return value


def env_budget() -> Budget:
    """The budget of ``SUBQUAD_MEMORY_BUDGET`` (``None`` when unset or empty)."""
    return checked_budget(setting_text(ENV_BUDGET), f"{ENV_BUDGET} (the environment variable)")
