"""How each training switch composes with a parallelized model: compile, precision, AC."""

__all__: list[str] = []
