"""mirror-rt devices: design notes in docs/design/devices.md."""
