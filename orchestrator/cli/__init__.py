"""The console scripts: parse, call a study or a run, turn user errors into one line."""
