"""What the mixers share for context parallelism (``forward(..., cp_group=group)``): the check of
the arguments that do not combine with it. The exchanges themselves are ``ssm.distributed``'s."""

from __future__ import annotations


def check_context_parallel(mixer: str, cache, cu_seqlens, last: int, takes_cache: bool = True) -> None:
    """A ValueError naming the argument that ``cp_group`` does not take: ``last``; a cache where
    the mixer takes none under it (``takes_cache`` False), or together with ``cu_seqlens``."""
    if last > 0:
        raise ValueError(f"{mixer}.forward: last is not supported with cp_group (context parallelism)")
    if cache is not None and not takes_cache:
        raise ValueError(f"{mixer}.forward: cache is not supported with cp_group (context parallelism)")
    if cache is not None and cu_seqlens is not None:
        raise ValueError(
            f"{mixer}.forward: cache together with cu_seqlens is not supported with cp_group (context parallelism)"
        )
