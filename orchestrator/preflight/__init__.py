"""Pre-flight: the rank traces checked, signed and grouped before any actor starts."""
