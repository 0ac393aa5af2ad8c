"""The wire: what every role must agree on byte for byte, and nothing that moves bytes.

The protocol (a header frame, each op's OpSpec, error codes, payloads), the bfloat16
codec of arrays sent in half their bytes, the Layout (which shard owns which slice of the
flat parameter vector, hashed into every request) and the row keys' hash (which shard
owns which embedding row). Pure functions and values over numpy; it may use only the
runtime's top-level modules (errors, contract) and nothing above it.
"""
