"""Ray for the driver: connect or start it, place and call one actor per rank."""
