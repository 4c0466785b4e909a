"""Thin re-exports of PyTorch's distributed tensor stack."""
