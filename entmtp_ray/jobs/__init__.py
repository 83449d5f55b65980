"""The jobs behind the console scripts (entmtp-generate, ...) and jobs/*.py; argparse -> config -> library
call -> one JSON summary line. Nothing here is imported by the library."""
