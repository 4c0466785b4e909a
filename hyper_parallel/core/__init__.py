"""Thin re-exports of PyTorch's distributed tensor stack (see ``hyper_parallel.core.dtensor``)."""

__all__: list[str] = []
