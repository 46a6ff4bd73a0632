"""Generated gRPC stubs of proto/foreshock/v1 (make proto). Do not edit: regenerate."""
