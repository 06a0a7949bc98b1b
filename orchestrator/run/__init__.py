"""One replay end to end (launch, session, aggregation, original run) and one capture job."""
