"""The jobs behind the `entmtp` commands (entmtp batch, ...) and jobs/*.py; argparse -> config -> library
call -> one JSON summary line. Nothing here is imported by the library."""
