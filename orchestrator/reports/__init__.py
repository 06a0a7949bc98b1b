"""What runs leave for people: console tables, run files, PNG plots, the HTML page."""
