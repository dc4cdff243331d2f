"""Optimizer state: a slab per group of like parameters, and what runs over it, one concept a module."""
