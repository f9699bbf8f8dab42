"""Shared test builders (plain functions and constants); fixtures live in conftest.py."""
