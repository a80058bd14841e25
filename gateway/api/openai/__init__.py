"""The OpenAI protocols, one adapter module each: chat completions (`chat`), the Responses API
(`responses`). Each translates its requests into `gateway.conversation` types and the neutral
output events back into its wire format."""
