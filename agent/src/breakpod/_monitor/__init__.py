"""Tensor monitors: rules and planning, then hooks and the step pipeline."""
