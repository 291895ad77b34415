"""Thin Typer commands: parse arguments, call the library, render the result."""
