"""The Hugging Face commands, above the trainer: ``verify-hf`` (:mod:`.verify`),
``export-hf`` (:mod:`.export`), ``generate`` (:mod:`.generate`) and their command lines
(:mod:`.commands`).

They use the library below the trainer (:mod:`hyper_parallel.checkpoint_hf`: config
conversion, name mapping, slice reads and writes) and the trainer itself; nothing
below imports them.
"""

__all__: list[str] = []
