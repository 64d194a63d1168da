"""Prompts, offline: the built-in set whose answers by the teacher self-distillation trains on, and the chat
prompts that judge a converted model (never among the training ones).

The training set crosses instructions with topics from many fields (science, history, programming,
everyday life), so the teacher's answers cover more than one domain of text. A user's own prompts come
from a text file, one a line.
"""

from __future__ import annotations

from pathlib import Path

from ladder.errors import LadderError

BUILTIN = "builtin"

INSTRUCTIONS = (
    "Explain {} to a beginner.",
    "What are the main ideas behind {}?",
    "Write a short paragraph about {}.",
    "Give three interesting facts about {}.",
    "What is the history of {}?",
    "Why does {} matter?",
    "Describe {} in simple terms.",
    "What are common misconceptions about {}?",
    "Write a short poem about {}.",
    "List the advantages and disadvantages of {}.",
    "How would you teach {} to a child?",
    "Write a friendly email to a colleague about {}.",
    "What questions should I ask to learn more about {}?",
    "Compare {} with something similar.",
    "Tell a short story that involves {}.",
    "What would a textbook say about {}?",
)

TOPICS = (
    "photosynthesis", "the French Revolution", "recursion in programming", "Python dictionaries", "black holes",
    "the water cycle", "machine learning", "baking bread", "the stock market", "climate change", "the Roman Empire",
    "vaccines", "prime numbers", "the theory of evolution", "electric cars", "jazz music", "the human heart",
    "volcanoes", "the internet", "Shakespeare's plays", "renewable energy", "the immune system", "gravity",
    "democracy", "the Renaissance", "sleep", "coffee", "chess", "the moon landing", "bees", "inflation", "DNA",
    "version control with git", "sorting algorithms", "the printing press", "earthquakes", "healthy eating",
    "public speaking", "time management", "the Great Wall of China", "rainbows", "the Olympic Games",
    "quantum computing", "plate tectonics", "the solar system", "classical music", "ancient Egypt", "recycling",
    "meditation", "electricity", "the periodic table", "probability", "relational databases", "operating systems",
    "unit testing", "regular expressions", "the Industrial Revolution", "coral reefs", "friendship",
    "learning a new language", "personal budgeting", "gardening", "mountains", "the ocean",
)

# Judged, never trained on: greedy answers of a converted model beside the original's.
CHAT_EVAL = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Who wrote Romeo and Juliet?",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Give me a simple recipe for pancakes.",
    "Translate 'good morning' into Spanish.",
    "What is 15 times 12?",
    "Write a haiku about autumn.",
    "What is the boiling point of water in Fahrenheit?",
    "Explain what a noun is.",
    "Suggest a name for a pet goldfish.",
    "Why is the sky blue?",
    "What is the largest planet in our solar system?",
    "How many days are in a leap year?",
    "What does a CPU do?",
    "Give me two tips for studying for an exam.",
    "Who painted the Mona Lisa?",
    "What is the difference between weather and climate?",
    "Write one sentence that uses the word 'serendipity'.",
    "What is an API?",
    "How do plants get their energy?",
    "What should I pack for a day hike?",
    "Summarize the plot of Cinderella in two sentences.",
)


def builtin_prompts() -> list[str]:
    """Every instruction about every topic (1,024 prompts), topic by topic."""
    return [instruction.format(topic) for topic in TOPICS for instruction in INSTRUCTIONS]


def read_prompts(source: str) -> list[str]:
    """`builtin`, or a text file of prompts, one a line (blank lines skipped)."""
    if source == BUILTIN:
        return builtin_prompts()
    path = Path(source)
    if not path.is_file():
        raise LadderError(f"no prompts file at {source} (or use answers:{BUILTIN})")
    prompts = [line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    if not prompts:
        raise LadderError(f"the prompts file {source} holds no prompts")
    return prompts
