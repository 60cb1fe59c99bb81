"""The MPI engine's sent-message table: ``SentMessages`` lives in ``sent_messages`` ([Note: the
sent-message table]), which the Gloo engine shares; this module keeps MPI's imports working. Each
MPI rank's table sits in its progress board's map, after the call slots (``mpi_progress``), and a
receive compares it once its message has arrived (``mpi_p2p``, [Note: what a receive checks]).
"""
from __future__ import annotations

from distframe.backends.sent_messages import AREA_BYTES, ENTRIES, ENTRY_BYTES, SentMessages

__all__ = ["AREA_BYTES", "ENTRIES", "ENTRY_BYTES", "SentMessages"]
