"""What the mixers share for context parallelism (``forward(..., cp_group=group)``): the check of
the arguments that do not combine with it. The exchanges themselves are ``ssm.distributed``'s."""

from __future__ import annotations


def check_context_parallel(mixer: str, cache, cu_seqlens, last: int) -> None:
    """A ValueError naming the argument that ``cp_group`` does not take yet: a cache (prefill
    continues one sequence on one process), ``last``, and packed sequences where the mixer
    passes None for ``cu_seqlens`` here because it takes them."""
    for name, given in (("cache", cache is not None), ("cu_seqlens", cu_seqlens is not None), ("last", last > 0)):
        if given:
            raise ValueError(f"{mixer}.forward: {name} is not supported with cp_group (context parallelism)")
