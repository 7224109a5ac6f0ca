"""mirror-rt evaluation: design notes in docs/design/evaluation.md."""
