"""The package version, in a module of its own: whatever needs it imports it without the package."""

__version__ = "0.1.0"
