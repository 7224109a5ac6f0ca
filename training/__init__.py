"""mirror-rt training: design notes in docs/design/training.md."""
