"""Serving across hosts on Ray Serve (`gateway serve --cluster ray`; the `cluster` extra).

- `replica.ModelReplica`: one model's engine on a node (a Serve replica, hosting an engine worker);
- `engine.ServeEngine`: a model's deployment as one `Engine` in the ingress;
- `router.AffinityRouter`: a conversation's next turn to the replica that holds its KV;
- `app`: the Serve application (the gateway's FastAPI app as ingress, a deployment per model);
- `runtime`: joining or starting Ray with token authentication, and running the application.

Nothing outside this package imports Ray: a single-host install never needs it.
"""
