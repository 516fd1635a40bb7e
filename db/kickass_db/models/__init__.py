"""Every table of the measurement database as typed models on the one ``Base``.

One module per subject; importing this package puts every table in
``Base.metadata`` (Alembic's autogenerate check and the tests read it). The
model modules import only ``kickass_db.base``, never this package.
"""

from __future__ import annotations

from ..base import Base
from . import (
    archive,
    atlas,
    counts,
    experiments,
    operations,
    quarantine,
    rollups,
    router,
    study,
    trials,
)

metadata = Base.metadata

__all__ = [
    "Base",
    "archive",
    "atlas",
    "counts",
    "experiments",
    "metadata",
    "operations",
    "quarantine",
    "rollups",
    "router",
    "study",
    "trials",
]
