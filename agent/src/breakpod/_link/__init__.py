"""The broker link: the typed client, the emitter, command handling."""
