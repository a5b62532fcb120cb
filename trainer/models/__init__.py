"""The trainer's model code: the family table (`families`), the shared blocks (`common`), one decoder per kind."""
