"""gRPC stubs generated from jengine.proto (regenerate with the command in that file)."""
