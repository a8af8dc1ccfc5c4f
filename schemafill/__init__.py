"""SchemaFill core: the tool-call contract, configuration, tracking and (later) the
runtime and drafter shared by every stage. Pure modules here import only the standard
library and torch."""
