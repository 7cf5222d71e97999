"""The gRPC API's messages and stubs (``inference.proto``; ``inference_pb2*``
are generated from it by ``make proto``, never edited): the gateway serves
it, and a client or the load generator calls it."""
