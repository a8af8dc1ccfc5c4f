"""Stage package for decoding and evaluation: AR, EAGLE-3 and SchemaFill decoders on one
runtime, and the reports built from their metrics."""
