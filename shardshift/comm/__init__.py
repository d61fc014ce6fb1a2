"""Moving bytes between ranks: point-to-point transfers on an explicitly given group, with a
deadline and errors that name the peer (`p2p.py`). Used by both executors: the layout switch's
(`shardshift.reshard`) and the tree collectives' (`shardshift.collectives.execution`)."""

from shardshift.comm.p2p import Deadline, PeerOp, PostedRound, TransferError, Transport

__all__ = ["Deadline", "PeerOp", "PostedRound", "TransferError", "Transport"]
