"""Load generators and benchmark harnesses (speak HTTP to any OpenAI-compatible server)."""
