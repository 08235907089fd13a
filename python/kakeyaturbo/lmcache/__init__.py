"""kakeyaturbo as an LMCache serde (``pip install kakeyaturbo[lmcache]``).

Importing this package registers the ``kakeya`` serde with LMCache's registry, so an L2
adapter config can name it: ``"serde": {"type": "kakeya", "bundle": ..., ...}`` (see
``docs/lmcache.md`` and :mod:`.options`). The LMCache server must import it first (for
example ``python -c "import kakeyaturbo.lmcache; ..."`` or a sitecustomize).
"""

from __future__ import annotations

from .container import KakeyaFormatError
from .options import SerdeOptions

__all__ = ["SERDE_NAME", "KakeyaFormatError", "SerdeOptions", "register"]

SERDE_NAME = "kakeya"


def register() -> str:
    """Registers the ``kakeya`` serde with LMCache (once; later calls do nothing) and returns
    its name. Raises ImportError naming the extra when LMCache is not installed."""
    try:
        from lmcache.v1.distributed.serde import factory
    except ImportError as e:
        raise ImportError(
            "kakeyaturbo.lmcache needs LMCache: pip install 'kakeyaturbo[lmcache]'"
        ) from e
    from .serde import create_kakeya_serde

    if SERDE_NAME not in factory.get_registered_serde_types():
        factory.register_serde_factory(SERDE_NAME, create_kakeya_serde)
    return SERDE_NAME


register()
