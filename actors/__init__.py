"""Everything that runs inside one rank: trace model, replay engine, capture."""
