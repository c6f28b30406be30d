"""Sharded checkpoints that any later layout can load, written so that a crash never loses the last one.

* :mod:`~pyparallel.checkpoint.format` — the format: :class:`Piece` (where a shard sits in the global
  tensor), the manifest, :class:`CheckpointError`; a leaf module every strategy may import.
* :mod:`~pyparallel.checkpoint.protocol` — how a model or optimizer describes its pieces and takes them
  back (``checkpoint_pieces`` / ``load_checkpoint_pieces``, ZeRO, plain modules, torch optimizers).
* :mod:`~pyparallel.checkpoint.store` — :func:`save` (atomic), :func:`load`, :func:`resolve`,
  :func:`read_tensors`, :func:`complete_steps` / :func:`newest_complete` (what to fall back to when
  ``latest`` is broken).
* :mod:`~pyparallel.checkpoint.nodelocal` — ``storage="node-local"``: each node's own folder holds its
  ranks' pieces; :func:`newest_common` (the newest save complete on every node).
* :mod:`~pyparallel.checkpoint.export` — :func:`export_pretrained` (a Hugging Face folder: shards, index,
  config.json) and :func:`export_consolidated` (one file), streamed one tensor at a time.
"""

from pyparallel.checkpoint.export import export_consolidated, export_pretrained
from pyparallel.checkpoint.format import FORMAT, VERSION, CheckpointError, Piece, read_manifest
from pyparallel.checkpoint.nodelocal import newest_common
from pyparallel.checkpoint.protocol import gather_full
from pyparallel.checkpoint.store import (
    complete_steps,
    load,
    newest_complete,
    read_tensors,
    resolve,
    save,
)

__all__ = ["FORMAT", "VERSION", "CheckpointError", "Piece", "complete_steps", "export_consolidated",
           "export_pretrained", "gather_full", "load", "newest_common", "newest_complete", "read_manifest",
           "read_tensors", "resolve", "save"]
