"""The deployment-engine test app of tests/test_flower_deployment.py."""
